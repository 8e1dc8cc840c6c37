// to_text(): a KeelConfig as text format with every field printed, zeros and falses included
// (TextFormat::Printer leaves proto3 defaults out), so that merging it over default_config()
// reproduces the config exactly.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>

#include <string>

#include "framework/config/config.h"

namespace keel {
namespace {

namespace pb = google::protobuf;

void print_message(const pb::Message& msg, int indent, std::string& out) {
  const pb::Descriptor* d = msg.GetDescriptor();
  const pb::Reflection* r = msg.GetReflection();
  const std::string pad(indent, ' ');
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      out += pad + f->name() + " {\n";
      print_message(r->GetMessage(msg, f), indent + 2, out);
      out += pad + "}\n";
    } else {
      std::string value;
      pb::TextFormat::PrintFieldValueToString(msg, f, -1, &value);
      out += pad + f->name() + ": " + value + "\n";
    }
  }
}

}  // namespace

std::string to_text(const config::KeelConfig& cfg) {
  std::string out;
  print_message(cfg, 0, out);
  return out;
}

}  // namespace keel
