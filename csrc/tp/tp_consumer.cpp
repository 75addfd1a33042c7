#include "tp/tp_consumer.h"

#include "common/status.h"
#include "gemm/cublaslt_gemm.h"
#include "gemm/gemm_internal.h"

namespace distgemm::tp {

dg_status CutlassRingGemm::check(const StepGemm& gemm, bool waits) const {
  // A step that waits for its chained C needs a kernel that calls the scheduler's epilogue hook.
  return gemm::check_gemm_desc(gemm.desc, waits && gemm.chain_c != nullptr);
}

dg_status CutlassRingGemm::run(const StepGemm& gemm, const SyncParams* waits, cudaStream_t stream) const {
  gemm::GemmExtras extras;
  extras.chain_c = gemm.chain_c;
  extras.chain_ldc = gemm.chain_ldc;
  if (waits) {
    extras.sync = *waits;
    extras.sm_count = sm_count_ - kFreeSms;
  }
  return gemm::run_gemm_desc(gemm.desc, extras, stream);
}

const char* CublasLtPieces::unsupported(const StepGemm& gemm) const {
  if (const char* why = gemm::cublaslt_unsupported(gemm.desc, gemm.chain_c != nullptr)) return why;
  // cuBLASLt's own word (e.g. outer-vector FP8 scales on a GPU or version without them): the
  // automatic choice then takes the fused algorithm instead of failing.
  if (gemm::plan_cublaslt_gemm(gemm.desc, gemm.chain_c, gemm.chain_ldc, scratch_bytes_) != DG_SUCCESS)
    return "a GEMM cuBLASLt has no algorithm for";
  return nullptr;
}

dg_status CublasLtPieces::check(const StepGemm& gemm, bool waits) const {
  DG_REQUIRE(!waits, "the cuBLASLt pieces cannot wait inside their kernels (the plan waits before them)");
  DG_RETURN_IF_ERROR(dg_gemm_check(&gemm.desc, arch_));  // shapes and layouts
  return gemm::plan_cublaslt_gemm(gemm.desc, gemm.chain_c, gemm.chain_ldc, scratch_bytes_);
}

dg_status CublasLtPieces::run(const StepGemm& gemm, const SyncParams*, cudaStream_t stream) const {
  return gemm::run_cublaslt_gemm(gemm.desc, gemm.chain_c, gemm.chain_ldc, scratch_, scratch_bytes_, stream);
}

}  // namespace distgemm::tp
