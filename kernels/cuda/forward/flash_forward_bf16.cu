// bfloat16 instantiations of the tensor-core kernel (flash_forward_kernel.cuh has the design
// notes).
#include "kernels/cuda/forward/flash_forward_launch.cuh"
#include "kernels/cuda/forward/launchers.h"

namespace attention::cuda {

cudaError_t LaunchFlashForwardBF16(const KernelParams& p, cudaStream_t stream) {
  return LaunchFlashForward<__nv_bfloat16>(p, stream);
}

int FlashForwardSmemBytesBF16(int head_dim) {
  return FlashForwardSmemBytes<__nv_bfloat16>(head_dim);
}

}  // namespace attention::cuda
