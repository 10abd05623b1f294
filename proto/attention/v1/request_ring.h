// The layout of a request ring (attention.v1.SharedMemory.OpenRing, docs/API.md "Request rings"):
// the part of the contract that is memory, not messages. Client and server share it in a system
// region, at the offset OpenRingRequest names:
//
//   [RingHeader, 448 bytes][slots request slots][slots response slots], each slot slot_bytes:
//   [uint64 length, little-endian][length bytes of one serialized message][unused]
//
// Request n (counting from 0) goes to request slot n % slots, its response (in the order the
// server answers, which may differ from the order sent: match them by request_id) to response
// slot m % slots for the server's m-th response. A side writes a slot, then publishes it by
// storing its counter (requests_posted, responses_posted) one higher; the other side reads the
// slot after loading that counter, and frees it by storing its own (requests_taken,
// responses_taken). The client may post while requests_posted - requests_taken < slots; the
// server answers while responses_posted - responses_taken < slots (so a client that stops reading
// stops the server at `slots` answers).
//
// Doorbells: a side that runs out of work spins a while, then sleeps on its bell, a futex word in
// the ring (shared between the processes, hence no FUTEX_PRIVATE_FLAG):
//   waiter:  waiting = 1; seen = bell; if (still nothing to do) futex_wait(bell, seen); waiting = 0
//   poster:  counter = n + 1; if (waiting) { ++bell; futex_wake(bell) }
// All four are sequentially consistent, so either the waiter sees the new counter or the poster
// sees `waiting` and the bell moves before or during the wait. The server also wakes at least
// every kServerTickMs, to see a cancelled call or a shrunk region.
//
// The server trusts none of the ring's words: counters that run ahead of what the ring holds and
// lengths larger than a slot end the ring with INVALID_ARGUMENT; it copies a request out of its
// slot before parsing it, so a client rewriting the slot meanwhile changes nothing.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>

namespace attention::ring {

inline constexpr int kMaxSlots = 64;
inline constexpr int64_t kMinSlotBytes = 4096;
inline constexpr int64_t kMaxSlotBytes = int64_t{64} << 20;
inline constexpr int64_t kAlignment = 64;   // of the ring's offset and of slot_bytes
inline constexpr int64_t kLengthBytes = 8;  // a slot's length word
inline constexpr int kServerTickMs = 10;

struct RingHeader {
  alignas(64) std::atomic<uint64_t> requests_posted;   // client
  alignas(64) std::atomic<uint64_t> requests_taken;    // server
  alignas(64) std::atomic<uint64_t> responses_posted;  // server
  alignas(64) std::atomic<uint64_t> responses_taken;   // client
  // 1 once the client posts no more requests: the server answers those posted, then ends the
  // call OK.
  alignas(64) std::atomic<uint32_t> client_closed;
  // 1 once the server serves the ring (a client may post before, but an OpenRing refused, e.g. for
  // a bad field, never sets it: wait for this or the call's end to learn which).
  std::atomic<uint32_t> server_open;
  // 1 once the server serves the ring no more; the OpenRing call's status says why.
  std::atomic<uint32_t> server_closed;
  alignas(64) std::atomic<uint32_t> server_bell;  // rung by the client (and the server's workers)
  std::atomic<uint32_t> server_waiting;
  alignas(64) std::atomic<uint32_t> client_bell;  // rung by the server
  std::atomic<uint32_t> client_waiting;
};
static_assert(sizeof(RingHeader) == 448);
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the ring's words are shared between processes: their atomics must be lock-free");

// The bytes a ring of `slots` slots of `slot_bytes` takes.
inline constexpr int64_t RingBytes(int slots, int64_t slot_bytes) {
  return static_cast<int64_t>(sizeof(RingHeader)) + 2 * int64_t{slots} * slot_bytes;
}

// Slot n % slots of the request (or response) half of the ring at `ring`.
inline char* RequestSlot(char* ring, int slots, int64_t slot_bytes, uint64_t n) {
  return ring + sizeof(RingHeader) +
         static_cast<int64_t>(n % static_cast<uint64_t>(slots)) * slot_bytes;
}
inline char* ResponseSlot(char* ring, int slots, int64_t slot_bytes, uint64_t n) {
  return RequestSlot(ring, slots, slot_bytes, n) + int64_t{slots} * slot_bytes;
}

// Sleeps while `bell` still reads `seen`, at most `timeout_ms`; returns early on a wake-up, a
// signal or a spurious wake, so the caller re-checks its condition.
inline void WaitBell(std::atomic<uint32_t>* bell, uint32_t seen, int timeout_ms) {
  const timespec timeout{.tv_sec = timeout_ms / 1000, .tv_nsec = (timeout_ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(bell), FUTEX_WAIT, seen, &timeout, nullptr, 0);
}

// Moves `bell` and wakes whoever sleeps on it.
inline void RingBell(std::atomic<uint32_t>* bell) {
  bell->fetch_add(1);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// One pause of a spinning wait (a hint to the core; on x86 it also spares the sibling thread).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The poster's half of the doorbell, after storing its counter.
inline void Notify(std::atomic<uint32_t>* waiting, std::atomic<uint32_t>* bell) {
  if (waiting->load() != 0) RingBell(bell);
}

}  // namespace attention::ring
