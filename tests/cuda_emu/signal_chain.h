// Passing a SIGSEGV on from one of the emulator's page-protection handlers (roofline.cc's byte
// counting, host_guard.cc's host guard) when the fault is not theirs: each saves the action that
// was in place when it installed itself and hands such faults to it.
#pragma once

#include <signal.h>

namespace keel_emu {

// Hands (sig, info, uc) to `previous`: its SA_SIGINFO handler or its plain one; for the default
// action (or ignore) it reinstates `previous`, so the faulting access runs again under it and the
// process dies of SIGSEGV as it would have without the handler (the emulator's guard page past an
// allocation, a use after cudaFree).
inline void chain_signal(const struct sigaction& previous, int sig, siginfo_t* info, void* uc) {
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, uc);
  } else if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
    sigaction(SIGSEGV, &previous, nullptr);
  } else {
    previous.sa_handler(sig);
  }
}

}  // namespace keel_emu
