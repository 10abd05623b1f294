// float8 e4m3 instantiations of the Hopper forward kernel (flash_forward_sm90_kernel.cuh has the
// design notes): head dims 128 and 256 only, the ones the plan sends here.
#include "kernels/cuda/forward/flash_forward_sm90_launch.cuh"
#include "kernels/cuda/forward/launchers.h"

namespace attention::cuda {

cudaError_t LaunchFlashForwardSm90F8(const KernelParams& p, cudaStream_t stream) {
  if (p.head_dim <= 64 || p.head_dim > 256) return cudaErrorInvalidValue;
  return p.head_dim <= 128 ? LaunchSm90Tile<Sm90TileFor<__nv_fp8_e4m3, 128>::Tile>(p, stream)
                           : LaunchSm90Tile<Sm90TileFor<__nv_fp8_e4m3, 256>::Tile>(p, stream);
}

int FlashForwardSm90F8SmemBytes(int head_dim) {
  return head_dim <= 128 ? Sm90TileFor<__nv_fp8_e4m3, 128>::Tile::kSmemBytes
                         : Sm90TileFor<__nv_fp8_e4m3, 256>::Tile::kSmemBytes;
}

}  // namespace attention::cuda
