// bfloat16 instantiations of the Hopper forward kernel (flash_forward_sm90_kernel.cuh has the
// design notes).
#include "kernels/cuda/forward/flash_forward_sm90_launch.cuh"
#include "kernels/cuda/forward/launchers.h"

namespace attention::cuda {

cudaError_t LaunchFlashForwardSm90BF16(const KernelParams& p, cudaStream_t stream) {
  return LaunchFlashForwardSm90<__nv_bfloat16>(p, stream);
}

int FlashForwardSm90SmemBytes(int head_dim) {
  return FlashForwardSm90MaxSmemBytes<__nv_bfloat16>(head_dim);
}

}  // namespace attention::cuda
