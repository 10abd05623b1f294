// Guards the server's mappings of shared-memory objects that clients own against a client
// shrinking its object (ftruncate) while the server reads or writes it: an access past the
// object's new end raises SIGBUS, which would kill the server. The same happens when the object's
// filesystem (/dev/shm) has no room for a page of a sparse object the server writes.
//
// A process-wide SIGBUS handler, installed once at the first GuardMapping and chained to the
// handler before it, looks the faulting address up in a fixed table of guarded mappings. Inside
// one, it maps zero-filled anonymous memory over the rest of that mapping (from the faulting page
// to its end), so the access completes, and marks the mapping as shrunk: its bytes no longer are
// the object's, so the request that touched it must fail and the region serve no more. A fault
// outside every guarded mapping goes to the previous handler, or takes the default action (a real
// crash stays a crash).
//
// The handler is async-signal-safe: the table is a fixed array of atomics, filled by GuardMapping
// before the mapping is used and cleared by UnguardMapping before munmap; it takes no lock and
// allocates nothing.
#pragma once

#include <cstddef>

namespace attention::server {

// At most this many mappings are guarded at once (every system region of every caller).
inline constexpr int kMaxGuardedMappings = 1024;

// Guards [base, base + bytes) (page-aligned base, as mmap answers); the handler is installed on
// the first call. Answers the mapping's slot, or -1 when kMaxGuardedMappings are guarded already.
int GuardMapping(void* base, size_t bytes);
// Forgets the slot's mapping; call it before munmap, with no access of the mapping running.
void UnguardMapping(int slot);
// Whether an access to the slot's mapping has faulted (and reads zeros from there on).
bool MappingShrunk(int slot);

}  // namespace attention::server
