#include "server/regions/shrink_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <mutex>

namespace attention::server {
namespace {

// One guarded mapping. `claimed` owns the slot (GuardMapping to UnguardMapping); the handler
// matches an address against [begin, end) while `begin` is non-zero.
struct Slot {
  std::atomic<bool> claimed{false};
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> shrunk{false};
};

// Lock-free atomics are what a signal handler may touch.
static_assert(std::atomic<uintptr_t>::is_always_lock_free &&
              std::atomic<bool>::is_always_lock_free);

Slot slots[kMaxGuardedMappings];
struct sigaction previous_action;  // written once, before the handler can run
uintptr_t page_bytes = 0;          // likewise (sysconf is not async-signal-safe)

// The previous handler's turn, for a fault that is not ours: call it, or restore the default
// action so the fault kills the process as it would have without us.
void Chain(int sig, siginfo_t* info, void* context) {
  if ((previous_action.sa_flags & SA_SIGINFO) != 0 && previous_action.sa_sigaction != nullptr) {
    previous_action.sa_sigaction(sig, info, context);
    return;
  }
  if (previous_action.sa_handler != SIG_DFL && previous_action.sa_handler != SIG_IGN) {
    previous_action.sa_handler(sig);
    return;
  }
  if (previous_action.sa_handler == SIG_IGN && info->si_code <= 0) return;  // sent, ignored
  struct sigaction fallback = {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(SIGBUS, &fallback, nullptr);
  // A fault re-runs the access on return and dies of it; a sent signal is delivered on return
  // (SIGBUS is blocked while this handler runs).
  if (info->si_code <= 0) raise(SIGBUS);
}

// Repairs a fault inside a guarded mapping; answers whether it did.
bool Repair(const siginfo_t* info) {
  // si_code > 0: raised by the kernel for an access (BUS_ADRERR past the end of an object);
  // otherwise sent by a process, and si_addr means nothing.
  if (info->si_code <= 0) return false;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& slot : slots) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin) continue;
    const uintptr_t end = slot.end.load(std::memory_order_acquire);
    if (addr >= end) continue;
    const uintptr_t page = addr & ~(page_bytes - 1);
    // The raw system call: sanitizers wrap mmap, and nothing but the kernel should run here.
    // MAP_NORESERVE: zero pages of a large tail must not fail for commit accounting.
    const long mapped = syscall(SYS_mmap, page, end - page, PROT_READ | PROT_WRITE,
                                MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapped == -1) break;  // cannot repair: a crash as before
    slot.shrunk.store(true, std::memory_order_release);
    return true;
  }
  return false;
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;  // the interrupted code's
  if (Repair(info)) {
    errno = saved_errno;
    return;  // the access runs again, on the zero pages
  }
  Chain(sig, info, context);
  errno = saved_errno;
}

void InstallHandler() {
  page_bytes = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  // SA_ONSTACK: run on the thread's alternate stack where one is set (sanitizers set one).
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &previous_action);
}

}  // namespace

int GuardMapping(void* base, size_t bytes) {
  static std::once_flag installed;
  std::call_once(installed, InstallHandler);
  for (int i = 0; i < kMaxGuardedMappings; ++i) {
    bool free = false;
    if (!slots[i].claimed.compare_exchange_strong(free, true)) continue;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(base);
    slots[i].shrunk.store(false, std::memory_order_relaxed);
    // The whole pages the mapping covers: an access to the last page's tail faults there too.
    slots[i].end.store((begin + bytes + page_bytes - 1) & ~(page_bytes - 1),
                       std::memory_order_release);
    slots[i].begin.store(begin, std::memory_order_release);  // last: the handler may match now
    return i;
  }
  return -1;
}

void UnguardMapping(int slot) {
  slots[slot].begin.store(0, std::memory_order_release);
  slots[slot].end.store(0, std::memory_order_release);
  slots[slot].claimed.store(false, std::memory_order_release);
}

bool MappingShrunk(int slot) { return slots[slot].shrunk.load(std::memory_order_acquire); }

}  // namespace attention::server
