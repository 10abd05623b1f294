// float32 (3xTF32) instantiations of the tensor-core kernel (design notes in
// flash_forward_kernel.cuh).
#include "kernels/cuda/forward/flash_forward_launch.cuh"
#include "kernels/cuda/forward/launchers.h"

namespace attention::cuda {

cudaError_t LaunchForwardF32(const KernelParams& p, cudaStream_t stream) {
  return LaunchFlashForward<float>(p, stream);
}

int FlashForwardSmemBytesF32(int head_dim) { return FlashForwardSmemBytes<float>(head_dim); }

}  // namespace attention::cuda
