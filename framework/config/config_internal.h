// Internals shared by framework/config/*.cc (config.cc: loading and --set; config_validate.cc:
// validate()); not part of keel's API. They live in keel::config_detail so that keel::config stays
// the namespace of the code protoc generates from keel.proto.
#pragma once

#include <google/protobuf/descriptor.h>

#include <string>

namespace keel::config_detail {

// "NONE, RMS, LAYER, L2": the names a user may choose (the *_UNSPECIFIED zero is left out).
std::string enum_choices(const google::protobuf::EnumDescriptor* e);

}  // namespace keel::config_detail
