// float32 instantiations of the paged decode kernels (paged_decode_kernel.cuh has the design
// notes).
#include "kernels/cuda/decode/paged_decode_launch.cuh"

namespace attention::cuda {

cudaError_t LaunchPagedDecodeF32(const PagedKernelParams& p, const PagedLaunch& launch,
                                 cudaStream_t stream) {
  return LaunchPagedDecodeFor<float>(p, launch, stream);
}

}  // namespace attention::cuda
