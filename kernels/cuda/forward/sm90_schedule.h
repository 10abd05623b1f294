// The order in which the Hopper forward kernel's CTAs take their work tiles (a work tile: a query
// tile of one (head, item) pair), shared by the kernel (flash_forward_sm90_kernel.cuh) and its
// host-side test (tests/kernels/cuda_plan_test.cc).
//
// CTAs take positions dynamically (each CTA's first is its blockIdx.x, every next one an
// atomicAdd on KernelParams::tile_counters), so a CTA that drew light tiles takes more of them
// (with a static round-robin over this order one CTA draws 1.7x the average work at D = 128,
// N = 4096 causal, counted on the host; measured 0.39 against 0.61 PFLOP/s dynamic). Position
// order: groups of `group` (head, item)
// pairs; within a group the query tiles heaviest first (most keys under a causal mask), the
// group's pairs interleaved, so the CTAs running at once work on a few heads and share their K
// and V in L2 (ordered by query tile across all heads, each CTA streamed its own head's K and V
// from memory: 0.60 instead of 0.66 PFLOP/s at D = 128, N = 4096). Masked launches take groups of
// 8 pairs; unmasked ones 1 (every tile costs the same there).
#pragma once

#include "kernels/host_device.h"

namespace attention::cuda {

struct Sm90Schedule {
  int m_blocks;  // query tiles per pair
  int pairs;     // (head, item) pairs
  int group;     // pairs per group
  int work_tiles;
};

// The schedule of a launch of seqlen_q query rows (varlen: the longest item's) in tiles of
// `tile_rows`, heads_q x batch pairs, with or without a mask.
ATTENTION_HOST_DEVICE inline Sm90Schedule MakeSm90Schedule(int seqlen_q, int tile_rows, int heads_q,
                                                           int batch, bool masked) {
  Sm90Schedule sc;
  sc.m_blocks = (seqlen_q + tile_rows - 1) / tile_rows;
  sc.pairs = heads_q * batch;
  const int group = masked ? 8 : 1;
  sc.group = group < sc.pairs ? group : sc.pairs;
  sc.work_tiles = sc.m_blocks * sc.pairs;
  return sc;
}

struct Sm90TileCoords {
  int m_block;  // the query tile
  int pair;     // head + heads_q x item
};

// The work tile at position pos (0 <= pos < work_tiles).
ATTENTION_HOST_DEVICE inline Sm90TileCoords Sm90TileAt(const Sm90Schedule& sc, int pos) {
  const int first_pair = pos / (sc.group * sc.m_blocks) * sc.group;
  const int left = sc.pairs - first_pair;
  const int in_group = sc.group < left ? sc.group : left;  // the last group may be short
  const int r = pos - first_pair * sc.m_blocks;
  return {sc.m_blocks - 1 - r / in_group, first_pair + r % in_group};
}

}  // namespace attention::cuda
