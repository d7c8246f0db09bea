// The decode GEMM's eager call in C++: per call shape, the Triton launches that the Python path
// (kernels_fused/hopper/decode.py) found, replayed from one call (key, allocations, argument
// packing, driver launch) instead of a dozen Python steps. Built and described by
// kernels_fused/hopper/native.py; a call it cannot take returns None and the Python path runs.
//
// Built against torch's CPU headers only: the CUDA driver, cuBLAS and cuBLASLt are reached through
// dlopen, the stream comes from the caller, so no CUDA toolkit is needed to build it (and CI builds
// it on a CPU).
#include <torch/extension.h>

#include <dlfcn.h>

#include <array>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
constexpr CUresult kSuccess = 0;
constexpr CUresult kCooperativeTooLarge = 720;  // CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
constexpr CUresult kNotSupported = 801;         // CUDA_ERROR_NOT_SUPPORTED (an SM share refuses)

// The first of ``names`` already loaded (torch loads its CUDA libraries), else the first that loads.
void* open_library(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (void* lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD)) return lib;
  for (const char* name : names)
    if (void* lib = dlopen(name, RTLD_LAZY)) return lib;
  return nullptr;
}

// f = ``lib``'s entry point ``name``; the first one missing is said in ``missing``.
template <typename F>
void bind(void* lib, F& f, const char* name, const char* library, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (f == nullptr && missing.empty()) missing = std::string(library) + " has no " + name;
}

// The driver's entry points this file calls (cuda.h's signatures, with opaque handles).
struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**) = nullptr;
  CUresult (*launch_cooperative)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 CUstream, void**) = nullptr;
  CUresult (*is_capturing)(CUstream, int*) = nullptr;
  CUresult (*ctx_device)(int*) = nullptr;
  CUresult (*param_info)(CUfunction, size_t, size_t*, size_t*) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  std::string missing;  // why the driver cannot be used ("" where it can)

  Driver() {
    void* lib = open_library({"libcuda.so.1"});  // torch has loaded it where there is a GPU
    if (lib == nullptr) {
      missing = "libcuda.so.1 cannot be loaded";
      return;
    }
    const char* what = "the driver";
    bind(lib, launch, "cuLaunchKernel", what, missing);
    bind(lib, launch_cooperative, "cuLaunchCooperativeKernel", what, missing);
    bind(lib, is_capturing, "cuStreamIsCapturing", what, missing);
    bind(lib, ctx_device, "cuCtxGetDevice", what, missing);
    bind(lib, param_info, "cuFuncGetParamInfo", what, missing);  // CUDA 12.4+: the plans are checked against it
    bind(lib, error_string, "cuGetErrorString", what, missing);
  }

  std::string error(CUresult r) const {
    const char* s = nullptr;
    if (error_string != nullptr) error_string(r, &s);
    return std::string(s != nullptr ? s : "unknown CUDA error") + " (" + std::to_string(r) + ")";
  }
};

const Driver& driver() {
  static const Driver d;
  return d;
}

// cuBLASLt's entry points and the values of cublasLt.h this file uses (CUDA 12.9+: the blockwise
// scale modes), opened as the driver is: torch's CUDA build has loaded the library already.
using LtStatus = int;
struct LtAlgo {
  uint64_t data[8];  // cublasLtMatmulAlgo_t: opaque
};
struct LtHeuristic {  // cublasLtMatmulHeuristicResult_t
  LtAlgo algo;
  size_t workspace;
  LtStatus state;
  float waves;
  int reserved[4];
};
constexpr int kCompute32F = 68;             // CUBLAS_COMPUTE_32F
constexpr int kR32F = 0, kR16BF = 14, kR8FE4M3 = 28;  // cudaDataType_t
constexpr int kTransA = 3, kTransB = 4;     // CUBLASLT_MATMUL_DESC_TRANSA / _TRANSB
constexpr int kAScalePointer = 17, kBScalePointer = 18, kFastAccum = 25, kAScaleMode = 31, kBScaleMode = 32;
constexpr int kOpN = 0, kOpT = 1;
constexpr int32_t kScaleVec128 = 4, kScaleBlock128x128 = 5;  // cublasLtMatmulMatrixScale_t
constexpr int kPrefMaxWorkspace = 1;         // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES

struct Lt {
  LtStatus (*create)(void**) = nullptr;
  LtStatus (*desc_create)(void**, int, int) = nullptr;
  LtStatus (*desc_set)(void*, int, const void*, size_t) = nullptr;
  LtStatus (*desc_destroy)(void*) = nullptr;
  LtStatus (*layout_create)(void**, int, uint64_t, uint64_t, int64_t) = nullptr;
  LtStatus (*layout_destroy)(void*) = nullptr;
  LtStatus (*pref_create)(void**) = nullptr;
  LtStatus (*pref_set)(void*, int, const void*, size_t) = nullptr;
  LtStatus (*pref_destroy)(void*) = nullptr;
  LtStatus (*heuristic)(void*, void*, void*, void*, void*, void*, void*, int, LtHeuristic*, int*) = nullptr;
  LtStatus (*matmul)(void*, void*, const void*, const void*, void*, const void*, void*, const void*, const void*,
                     void*, void*, void*, const LtAlgo*, void*, size_t, CUstream) = nullptr;
  std::string missing;

  Lt() {
    void* lib = open_library({"libcublasLt.so.13", "libcublasLt.so.12"});  // the one torch loaded
    if (lib == nullptr) {
      missing = "libcublasLt cannot be loaded";
      return;
    }
    const char* what = "cuBLASLt";
    bind(lib, create, "cublasLtCreate", what, missing);
    bind(lib, desc_create, "cublasLtMatmulDescCreate", what, missing);
    bind(lib, desc_set, "cublasLtMatmulDescSetAttribute", what, missing);
    bind(lib, desc_destroy, "cublasLtMatmulDescDestroy", what, missing);
    bind(lib, layout_create, "cublasLtMatrixLayoutCreate", what, missing);
    bind(lib, layout_destroy, "cublasLtMatrixLayoutDestroy", what, missing);
    bind(lib, pref_create, "cublasLtMatmulPreferenceCreate", what, missing);
    bind(lib, pref_set, "cublasLtMatmulPreferenceSetAttribute", what, missing);
    bind(lib, pref_destroy, "cublasLtMatmulPreferenceDestroy", what, missing);
    bind(lib, heuristic, "cublasLtMatmulAlgoGetHeuristic", what, missing);
    bind(lib, matmul, "cublasLtMatmul", what, missing);
  }
};

const Lt& lt() {
  static const Lt l;
  return l;
}

void lt_check(LtStatus status, const char* what) {
  if (status != 0)
    throw std::runtime_error(std::string("cuBLASLt ") + what + " returned status " + std::to_string(status));
}

// One handle per device, made once and kept for the process (as torch keeps its own).
void* lt_handle(int64_t device) {
  static std::unordered_map<int64_t, void*> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  void* handle = nullptr;
  lt_check(lt().create(&handle), "cublasLtCreate");
  return handles[device] = handle;
}

// cuBLAS's bf16 GEMM as torch's at::mm calls it (ATen's CUDA BLAS wrapper for bf16): on torch's own
// handle for the current device and stream (at::cuda::getCurrentCUDABlasHandle, which also sets the
// handle's stream and torch's workspace), with torch's math-mode flags around cublasGemmEx. The same
// handle, workspace, arguments and flags as torch's call, so the same kernel and bits (held by
// decode.py's first-call comparison, _same_bits); what it saves is the dispatcher, mm's checks and its
// output's resize.
constexpr int kCublasDefaultMath = 0, kCublasDisallowReducedReduction = 16;  // cublasMath_t
constexpr int kCompute32FLegacy = 68;   // CUBLAS_COMPUTE_32F (torch passes CUDA_R_32F, migrated to it)
constexpr int kGemmDefaultTensorOp = 99;  // CUBLAS_GEMM_DEFAULT_TENSOR_OP

struct Cublas {
  void* (*current_handle)() = nullptr;  // at::cuda::getCurrentCUDABlasHandle()
  int (*set_math_mode)(void*, int) = nullptr;
  int (*gemm_ex)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                 const void*, void*, int, int, int, int) = nullptr;
  std::string missing;

  Cublas() {
    void* blas = open_library({"libcublas.so.13", "libcublas.so.12"});  // the one torch loaded
    void* torch_cuda = open_library({"libtorch_cuda.so"});
    if (blas == nullptr || torch_cuda == nullptr) {
      missing = blas == nullptr ? "libcublas cannot be loaded" : "libtorch_cuda.so is not loaded";
      return;
    }
    bind(blas, set_math_mode, "cublasSetMathMode", "cuBLAS", missing);
    bind(blas, gemm_ex, "cublasGemmEx", "cuBLAS", missing);
    bind(torch_cuda, current_handle, "_ZN2at4cuda24getCurrentCUDABlasHandleEv", "libtorch_cuda.so", missing);
  }
};

const Cublas& cublas() {
  static const Cublas c;
  return c;
}

// torch's setting as "reduced-precision reduction allowed" (1), disallowed (0), or a setting cuBLAS's
// call refuses (-1): a bool in older torch, CuBLASReductionOption since (a template, so that only the
// installed torch's branch is compiled).
template <typename Option>
int reduction_allowed(Option option) {
  if constexpr (std::is_same_v<Option, bool>) {
    return option ? 1 : 0;
  } else {
    if (option == Option::DisallowReducedPrecisionDisallowSplitK) return -1;  // torch refuses it on cuBLAS
    return option == Option::AllowReducedPrecisionWithSplitK ? 1 : 0;
  }
}

// The math-mode flags with which torch's at::mm of bf16 calls cuBLAS's GemmEx now
// (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction), or -1 where it would not call
// it so: another preferred BLAS library, deterministic algorithms (torch's call checks the workspace
// configuration first), a reduction setting cuBLAS refuses.
int torch_gemm_ex_flags() {
  auto& context = at::globalContext();
  if (context.blasPreferredBackend() != at::BlasBackend::Cublas || context.deterministicAlgorithms()) return -1;
  const int allowed = reduction_allowed(context.allowBF16ReductionCuBLAS());
  if (allowed < 0) return -1;
  return allowed ? kCublasDefaultMath : kCublasDisallowReducedReduction;
}

// out [rows, N] (contiguous bf16) = a [rows, K] times w [N, K]^T, both bf16 row-major: cuBLAS's
// column-major out^T [N, rows] = w^T' [N, K] . a^T [K, rows] ("t", "n"), as torch passes mm(a, w.t()).
void gemm_ex(const at::Tensor& a, const at::Tensor& w, at::Tensor& out, int flags) {
  const Cublas& c = cublas();
  void* handle = c.current_handle();
  const float alpha = 1.0f, beta = 0.0f;
  const int n = static_cast<int>(w.size(0)), rows = static_cast<int>(a.size(0)), k = static_cast<int>(a.size(1));
  lt_check(c.set_math_mode(handle, flags), "cublasSetMathMode");
  const int status = c.gemm_ex(handle, kOpT, kOpN, n, rows, k, &alpha, w.data_ptr(), kR16BF, k, a.data_ptr(), kR16BF,
                               k, &beta, out.data_ptr(), kR16BF, n, kCompute32FLegacy, kGemmDefaultTensorOp);
  c.set_math_mode(handle, kCublasDefaultMath);  // as torch leaves it
  if (status != 0) throw std::runtime_error("cuBLAS cublasGemmEx returned status " + std::to_string(status));
}

// torch's blockwise _scaled_mm of rows [rows, K] by a weight [N, K] (128x128 scales) into bf16
// [rows, N], made once per call shape: the descriptor, the four layouts and the algorithm its
// heuristic picks, asked as torch asks it (the same attributes, layouts and workspace bound), so
// that the same kernel runs and the bits are the same (test_cuda_nn's check_decode_vendor holds
// them equal). torch rebuilds all of it and asks the heuristic on every call: that is the host
// time this saves. Per call only the two scale pointers change.
class LtGemm {
 public:
  LtGemm(int64_t device, int64_t rows, int64_t n, int64_t k, size_t workspace_bound, const void* w_scale,
         const void* a_scale) {
    const Lt& l = lt();
    if (!l.missing.empty()) throw std::runtime_error(l.missing);
    try {
      make(device, rows, n, k, workspace_bound, w_scale, a_scale);
    } catch (...) {
      release();  // (a constructor that throws runs no destructor)
      throw;
    }
  }

  ~LtGemm() { release(); }

  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // out [rows, N] (contiguous bf16) = q [rows, K] (e4m3, M-major scales sa) times w [N, K] (scales
  // w_scale), on ``stream``; the workspace comes from the caching allocator, on that stream.
  void run(const at::Tensor& q, const at::Tensor& sa, const at::Tensor& w, const at::Tensor& w_scale, at::Tensor& out,
           CUstream stream) {
    const Lt& l = lt();
    const void* w_scale_ptr = w_scale.data_ptr();
    const void* a_scale_ptr = sa.data_ptr();
    set(kAScalePointer, &w_scale_ptr, sizeof w_scale_ptr);
    set(kBScalePointer, &a_scale_ptr, sizeof a_scale_ptr);
    at::Tensor workspace;
    if (workspace_ > 0) workspace = at::empty({static_cast<int64_t>(workspace_)}, q.options().dtype(at::kByte));
    const float alpha = 1.0f, beta = 0.0f;
    lt_check(l.matmul(handle_, desc_, &alpha, w.data_ptr(), a_, q.data_ptr(), b_, &beta, out.data_ptr(), c_,
                      out.data_ptr(), d_, &algo_, workspace_ > 0 ? workspace.data_ptr() : nullptr, workspace_, stream),
             "cublasLtMatmul");
  }

 private:
  void make(int64_t device, int64_t rows, int64_t n, int64_t k, size_t workspace_bound, const void* w_scale,
            const void* a_scale) {
    const Lt& l = lt();
    handle_ = lt_handle(device);
    lt_check(l.desc_create(&desc_, kCompute32F, kR32F), "cublasLtMatmulDescCreate");
    // torch's operands, swapped for cuBLAS's column-major terms: out^T [N, rows] = W [N, K] . rows^T
    const int32_t trans_a = kOpT, trans_b = kOpN, mode_a = kScaleBlock128x128, mode_b = kScaleVec128;
    const int8_t fast_accum = 0;
    set(kTransA, &trans_a, sizeof trans_a);
    set(kTransB, &trans_b, sizeof trans_b);
    set(kAScalePointer, &w_scale, sizeof w_scale);
    set(kBScalePointer, &a_scale, sizeof a_scale);
    set(kFastAccum, &fast_accum, sizeof fast_accum);
    set(kAScaleMode, &mode_a, sizeof mode_a);
    set(kBScaleMode, &mode_b, sizeof mode_b);
    lt_check(l.layout_create(&a_, kR8FE4M3, k, n, k), "cublasLtMatrixLayoutCreate");
    lt_check(l.layout_create(&b_, kR8FE4M3, k, rows, k), "cublasLtMatrixLayoutCreate");
    lt_check(l.layout_create(&c_, kR16BF, n, rows, n), "cublasLtMatrixLayoutCreate");
    lt_check(l.layout_create(&d_, kR16BF, n, rows, n), "cublasLtMatrixLayoutCreate");
    void* pref = nullptr;
    lt_check(l.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t bound = workspace_bound;
    LtStatus status = l.pref_set(pref, kPrefMaxWorkspace, &bound, sizeof bound);
    LtHeuristic result{};
    int returned = 0;
    if (status == 0) status = l.heuristic(handle_, desc_, a_, b_, c_, d_, pref, 1, &result, &returned);
    l.pref_destroy(pref);
    lt_check(status, "cublasLtMatmulAlgoGetHeuristic");
    if (returned == 0) throw std::runtime_error("cuBLASLt's heuristic found no algorithm for this call");
    algo_ = result.algo;
    workspace_ = result.workspace;  // what the chosen algorithm uses, within the bound
  }

  void release() {
    const Lt& l = lt();
    for (void** layout : {&a_, &b_, &c_, &d_}) {
      if (*layout != nullptr) l.layout_destroy(*layout);
      *layout = nullptr;
    }
    if (desc_ != nullptr) l.desc_destroy(desc_);
    desc_ = nullptr;
  }

  void set(int attribute, const void* value, size_t size) {
    lt_check(lt().desc_set(desc_, attribute, value, size), "cublasLtMatmulDescSetAttribute");
  }

  void* handle_ = nullptr;
  void* desc_ = nullptr;
  void *a_ = nullptr, *b_ = nullptr, *c_ = nullptr, *d_ = nullptr;
  LtAlgo algo_{};
  size_t workspace_ = 0;
};

// A kernel parameter: a pointer taken per call (ROLE), or 4 / 8 bytes fixed per call shape.
enum Kind : int64_t { kPointer = 0, kBits32 = 1, kBits64 = 2 };
// Which pointer: the call's tensors, the scratch (plus a byte offset), the stream's wait counter,
// none (Triton's global and profile scratch, unused by these kernels), a vendor plan's activation
// scales (its scratch holds the quantized rows), or a dense vendor plan's rows in bf16.
enum Role : int64_t {
  kX = 0, kW = 1, kScale = 2, kBiasOrOut = 3, kOut = 4, kScratch = 5, kSync = 6, kNull = 7, kAScale = 8, kRows = 9
};

struct Param {
  int64_t kind, value, offset;  // kPointer: value is the role, offset bytes past it; else the bits
};

struct Launch {
  CUfunction fn = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 0, shared = 0;
  bool cooperative = false, sync = false;
  std::vector<Param> params;
};

struct Plan {
  std::vector<Launch> one;  // the eager path where it is allowed (may be empty)
  std::vector<Launch> two;  // the path under a graph capture or with the one launch off (may be empty)
  int64_t scratch_one = 0, scratch_two = 0;  // bytes of scratch each path allocates
  // > 0: a vendor plan (decode.py's VENDOR_ROWS): ``two`` is the quantizer's launch into this many
  // zero-padded rows, then cuBLAS's blockwise GEMM (vendor_gemm below); over a bf16 weight (mxfp8's
  // copy: ``dense``) the quantizer's launch into bf16 rows (quantized, then dequantized), then
  // cuBLAS's bf16 GEMM (dense_gemm below)
  int64_t vendor_rows = 0;
  bool dense = false;
  std::shared_ptr<LtGemm> lt;  // a vendor plan's kept cuBLASLt call (eager calls; null: at::_scaled_mm)
  bool gemm_ex = false;        // a dense plan's eager calls call cuBLAS's GemmEx as torch's at::mm does
  py::object keep;  // the compiled kernels: their functions stay loaded while the plan is kept
};

// Everything the Python path's key holds (decode.py): what Triton specialized the launches on.
using Key = std::array<int64_t, 18>;

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

// x's rows as the kernels read them: (m, row stride, column stride), or m = 0 where the C++ path
// does not take x (a non-contiguous x of more than two dimensions is reshaped by the Python path).
std::array<int64_t, 3> rows_of(const at::Tensor& x) {
  const int64_t k = x.size(-1);
  if (x.dim() == 2) return {x.size(0), x.stride(0), x.stride(1)};
  if (x.dim() > 2 && x.is_contiguous() && k > 0) return {x.numel() / k, k, 1};
  return {0, 0, 0};
}

int64_t align16(const at::Tensor& t) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16); }

constexpr int64_t kScaleBlock = 128;  // blockscale's activation scale group

// Whether ``device`` is the current one (the driver's context): a launch and a cuBLASLt handle are
// made for the current device only.
bool current_is(const Driver& d, int64_t device) {
  int current = -1;
  return d.missing.empty() && d.ctx_device(&current) == kSuccess && current == device;
}

// A vendor plan's activation scales for ``rows`` rows, M-major as decode.py allocates them (cuBLAS's
// blockwise recipe reads them so).
at::Tensor m_major_scales(const at::Tensor& x, int64_t rows, int64_t k_padded) {
  return at::empty({k_padded / kScaleBlock, rows}, x.options().dtype(at::kFloat)).t();
}

// What decode.py's vendor_gemm and dense_gemm share: ``gemm(full)`` computes the vendor GEMM's whole
// product [q_rows, N_pad] into ``full``, which is the call's own out [m, n] where the shapes agree,
// else a new tensor whose share [:m, :n] is copied out (zero rows padded for cuBLAS, the weight's
// padded features); then out += bias.
template <typename Gemm>
void into_out(at::Tensor& out, int64_t m, int64_t n, int64_t q_rows, int64_t n_padded,
              const std::optional<at::Tensor>& bias, Gemm gemm) {
  at::Tensor rows = out.view({m, n});
  const bool whole = q_rows == m && n_padded == n;
  at::Tensor full = whole ? rows : at::empty({q_rows, n_padded}, out.options());
  gemm(full);
  if (!whole) rows.copy_(full.narrow(0, 0, m).narrow(1, 0, n));
  if (bias.has_value() && bias->defined()) out.add_(*bias);
}

// decode.py's vendor_gemm, call for call: out [..., n] = (q @ dequant(w).T)[:m, :n] (+ bias); through
// the plan's kept cuBLASLt call where it has one (eager), else through at::_scaled_mm as torch's call.
void vendor_gemm(const at::Tensor& q, const at::Tensor& sa, const at::Tensor& w, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t m, int64_t n, LtGemm* kept,
                 CUstream stream) {
  into_out(out, m, n, q.size(0), w.size(0), bias, [&](at::Tensor& full) {
    if (kept != nullptr)
      kept->run(q, sa, w, scale, full, stream);
    else
      at::_scaled_mm_out(full, q, w.t(), sa, scale.t(), std::nullopt, std::nullopt, at::kBFloat16, false);
  });
}

// decode.py's dense_gemm, call for call: out [..., n] = (a @ w.T)[:, :n] (+ bias) by cuBLAS's bf16
// GEMM over the weight's bf16 copy w [N_pad, K_pad]: cublasGemmEx as torch calls it where ``flags``
// >= 0 (its math-mode flags), else at::mm.
void dense_gemm(const at::Tensor& a, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out,
                int64_t m, int64_t n, int flags) {
  into_out(out, m, n, a.size(0), w.size(0), bias, [&](at::Tensor& full) {
    if (flags >= 0)
      gemm_ex(a, w, full, flags);
    else
      at::mm_out(full, a, w.t());
  });
}

bool key_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
            int64_t n, int64_t quant, Key& key) {
  if (!x.is_cuda() || x.dim() < 2 || w.dim() != 2 || scale.dim() < 1) return false;
  const auto rows = rows_of(x);
  if (rows[0] <= 0) return false;
  const bool has_bias = bias.has_value() && bias->defined();
  key = {rows[0], x.size(-1), static_cast<int64_t>(x.scalar_type()), rows[1], rows[2], align16(x), w.size(0), w.size(1),
         align16(w), scale.stride(0), align16(scale), static_cast<int64_t>(scale.scalar_type()), n, quant,
         has_bias ? align16(*bias) : -1, has_bias ? static_cast<int64_t>(bias->scalar_type()) : -1,
         static_cast<int64_t>(x.get_device()), static_cast<int64_t>(w.scalar_type())};
  return true;
}

class Table {
 public:
  Table(int64_t kept, int64_t sync_kept) : kept_(kept), sync_kept_(sync_kept) {}

  // bf16 [..., n] for the call, or None where this table does not take it (no plan for its key,
  // x on another device than the current one, a path the plan lacks): the caller's Python path
  // runs then. Raises RuntimeError where the driver refuses a launch ("cooperative" in the
  // message where it refused the one launch; the plan is dropped then). kept: a vendor plan's eager
  // call makes its vendor GEMM's call itself where the plan keeps one (blockscale's cuBLASLt call,
  // mxfp8's cublasGemmEx), else torch's (at::_scaled_mm, at::mm).
  py::object run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias, int64_t n, int64_t quant, bool one, bool kept,
                 uint64_t stream) {
    Key key;
    if (!key_of(x, w, scale, bias, n, quant, key)) return py::none();
    auto it = plans_.find(key);
    if (it == plans_.end()) return py::none();
    const Driver& d = driver();
    if (!current_is(d, x.get_device())) return py::none();
    CUstream s = reinterpret_cast<CUstream>(stream);
    int capturing = 0;
    if (d.is_capturing(s, &capturing) != kSuccess) return py::none();
    Plan& plan = it->second;
    const bool take_one = one && capturing == 0 && !plan.one.empty();
    const std::vector<Launch>& launches = take_one ? plan.one : plan.two;
    if (launches.empty()) return py::none();
    auto sizes = x.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, x.options().dtype(at::kBFloat16));
    const int64_t scratch_bytes = take_one ? plan.scratch_one : plan.scratch_two;
    at::Tensor scratch;
    if (scratch_bytes > 0) scratch = at::empty({scratch_bytes}, x.options().dtype(at::kByte));
    std::array<void*, kRoles> base{};
    base[kX] = x.data_ptr();
    base[kW] = w.data_ptr();
    base[kScale] = scale.data_ptr();
    base[kOut] = out.data_ptr();
    base[kBiasOrOut] = (bias.has_value() && bias->defined()) ? bias->data_ptr() : out.data_ptr();
    base[kScratch] = scratch_bytes > 0 ? scratch.data_ptr() : nullptr;
    base[kNull] = nullptr;
    at::Tensor q, sa, a;  // a vendor plan's quantized rows and their scales (mxfp8: bf16 rows), as decode.py allocates them
    if (plan.dense) {  // the quantizer writes mxfp8's rows dequantized, no scales
      a = at::empty({plan.vendor_rows, w.size(1)}, x.options().dtype(at::kBFloat16));
      base[kRows] = a.data_ptr();
    } else if (plan.vendor_rows > 0) {
      q = at::empty({plan.vendor_rows, w.size(1)}, x.options().dtype(at::kFloat8_e4m3fn));
      sa = m_major_scales(x, plan.vendor_rows, w.size(1));
      base[kScratch] = q.data_ptr();
      base[kAScale] = sa.data_ptr();
    }
    for (const Launch& l : launches) {
      if (l.sync) base[kSync] = sync_of(x, stream).data_ptr();
      std::array<uint64_t, kMaxParams> values{};
      std::array<void*, kMaxParams> args{};
      for (size_t i = 0; i < l.params.size(); ++i) {
        const Param& p = l.params[i];
        if (p.kind == kPointer) {
          auto* ptr = static_cast<char*>(base[p.value]);
          values[i] = reinterpret_cast<uint64_t>(ptr == nullptr ? nullptr : ptr + p.offset);
        } else {
          values[i] = static_cast<uint64_t>(p.value);  // little-endian: 32-bit values in the low bytes
        }
        args[i] = &values[i];
      }
      CUresult r = l.cooperative
                       ? d.launch_cooperative(l.fn, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared, s,
                                              args.data())
                       : d.launch(l.fn, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared, s, args.data(),
                                  nullptr);
      if (r != kSuccess) {
        if (l.cooperative && (r == kCooperativeTooLarge || r == kNotSupported)) {
          plans_.erase(it);
          throw std::runtime_error("decode_gemm: the cooperative launch was refused: " + d.error(r));
        }
        throw std::runtime_error("decode_gemm: a kernel launch failed: " + d.error(r));
      }
    }
    // kept: the caller's switch (decode.KEPT_CALL); a capture records torch's own call
    if (plan.dense) {
      const int flags = kept && capturing == 0 && plan.gemm_ex ? torch_gemm_ex_flags() : -1;
      dense_gemm(a, w, bias, out, key[0], n, flags);
      if (flags >= 0) ++kept_taken_;
    } else if (plan.vendor_rows > 0) {
      LtGemm* lt = kept && capturing == 0 ? plan.lt.get() : nullptr;
      vendor_gemm(q, sa, w, scale, bias, out, key[0], n, lt, s);
      if (lt != nullptr) ++kept_taken_;
    }
    ++taken_;
    return py::cast(out);
  }

  // How many calls this table took (tests: a call that should take it did), and how many of them
  // made their vendor GEMM's call themselves (a kept call); why the last vendor plan keeps none (""
  // where it keeps one).
  int64_t taken() const { return taken_; }
  int64_t kept_taken() const { return kept_taken_; }
  std::string kept_error() const { return kept_error_; }

  // The wait's counter of x's device and ``stream`` (tests: the one launch counted).
  at::Tensor sync_for(const at::Tensor& x, uint64_t stream) { return sync_of(x, stream); }

  // Keep the plan of the call (x, w, scale, bias, n, quant) (its key computed as run computes it).
  // one / two: per launch (function, (gx, gy, gz), threads, shared bytes, cooperative,
  // [(kind, value, offset), ...]); each is checked against the function's parameters as the driver
  // reports them, and a plan that disagrees is refused (ValueError, nothing kept). kept_call > 0: a
  // vendor plan keeps its own call of the vendor GEMM: blockscale's cuBLASLt call, asked with
  // kept_call bytes of workspace bound (torch's), a dense plan's cublasGemmEx (any value > 0); 0:
  // torch's call (at::_scaled_mm, at::mm). Where cuBLAS(Lt) cannot be opened or refuses, kept_error
  // says why and torch's call runs.
  void add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
           int64_t n, int64_t quant, const py::list& one, const py::list& two, int64_t scratch_one,
           int64_t scratch_two, int64_t vendor_rows, int64_t kept_call, py::object keep) {
    Key key;
    if (!key_of(x, w, scale, bias, n, quant, key)) throw py::value_error("decode_calls: this call cannot be planned");
    Plan plan;
    plan.one = launches_of(one);
    plan.two = launches_of(two);
    plan.scratch_one = scratch_one;
    plan.scratch_two = scratch_two;
    plan.vendor_rows = vendor_rows;
    plan.dense = vendor_rows > 0 && w.scalar_type() == at::kBFloat16;
    if (vendor_rows > 0 && (!plan.one.empty() || w.size(1) % kScaleBlock != 0 || plan.two.size() > 1))
      throw py::value_error("decode_calls: a vendor plan has the quantizer's launch alone, over K a multiple of 128");
    if (plan.dense && kept_call > 0) {
      plan.gemm_ex = cublas().missing.empty();
      kept_error_ = cublas().missing;
    } else if (vendor_rows > 0 && kept_call > 0 && !current_is(driver(), x.get_device())) {
      kept_error_ = "planned while another device was current: cuBLASLt's handle is made for the current one";
    } else if (vendor_rows > 0 && kept_call > 0) {
      try {  // the scales' pointers as a call's (the heuristic may read their alignment); each call sets its own
        at::Tensor sa = m_major_scales(x, vendor_rows, w.size(1));
        plan.lt = std::make_shared<LtGemm>(x.get_device(), vendor_rows, w.size(0), w.size(1),
                                           static_cast<size_t>(kept_call), scale.data_ptr(), sa.data_ptr());
        kept_error_.clear();
      } catch (const std::exception& err) {
        kept_error_ = err.what();
      }
    }
    plan.keep = std::move(keep);
    if (static_cast<int64_t>(plans_.size()) >= kept_) plans_.clear();
    plans_[key] = std::move(plan);
  }

  int64_t size() const { return static_cast<int64_t>(plans_.size()); }

  // The parameters' byte sizes of a compiled function as the driver reports them (checks).
  static std::vector<int64_t> param_sizes(uint64_t fn) {
    const Driver& d = driver();
    if (!d.missing.empty()) throw std::runtime_error("decode_calls: " + d.missing);
    std::vector<int64_t> sizes;
    for (size_t i = 0; i < 4 * kMaxParams; ++i) {
      size_t offset = 0, size = 0;
      if (d.param_info(reinterpret_cast<CUfunction>(fn), i, &offset, &size) != kSuccess) break;
      sizes.push_back(static_cast<int64_t>(size));
    }
    return sizes;
  }

 private:
  static constexpr size_t kRoles = 10;
  static constexpr size_t kMaxParams = 40;

  std::vector<Launch> launches_of(const py::list& described) {
    std::vector<Launch> out;
    for (const auto& item : described) {
      auto t = item.cast<py::tuple>();
      Launch l;
      l.fn = reinterpret_cast<CUfunction>(t[0].cast<uint64_t>());
      auto grid = t[1].cast<std::vector<int64_t>>();
      for (size_t i = 0; i < 3; ++i) l.grid[i] = static_cast<unsigned>(i < grid.size() ? grid[i] : 1);
      l.threads = t[2].cast<unsigned>();
      l.shared = t[3].cast<unsigned>();
      l.cooperative = t[4].cast<bool>();
      for (const auto& p : t[5].cast<py::list>()) {
        auto q = p.cast<std::array<int64_t, 3>>();
        if (q[0] == kPointer && (q[1] < 0 || q[1] >= static_cast<int64_t>(kRoles)))
          throw py::value_error("decode_calls: a pointer parameter of unknown role " + std::to_string(q[1]));
        if (q[0] == kPointer && q[1] == kSync) l.sync = true;
        l.params.push_back({q[0], q[1], q[2]});
      }
      if (l.params.size() > kMaxParams) throw py::value_error("decode_calls: too many kernel parameters");
      auto sizes = param_sizes(reinterpret_cast<uint64_t>(l.fn));
      if (sizes.size() != l.params.size())
        throw py::value_error("decode_calls: the function takes " + std::to_string(sizes.size()) +
                              " parameters, the plan gives " + std::to_string(l.params.size()));
      for (size_t i = 0; i < sizes.size(); ++i) {
        const int64_t want = l.params[i].kind == kBits32 ? 4 : 8;
        if (sizes[i] != want)
          throw py::value_error("decode_calls: parameter " + std::to_string(i) + " is " + std::to_string(sizes[i]) +
                                " bytes, the plan gives " + std::to_string(want));
      }
      out.push_back(std::move(l));
    }
    return out;
  }

  // The grid-wide wait's int32 [count, generation] of (device, stream), zeroed once (decode.py's _sync).
  const at::Tensor& sync_of(const at::Tensor& x, uint64_t stream) {
    const std::pair<int64_t, uint64_t> key{x.get_device(), stream};
    auto it = syncs_.find(key);
    if (it != syncs_.end()) return it->second;
    if (static_cast<int64_t>(syncs_.size()) >= sync_kept_) syncs_.clear();
    return syncs_[key] = at::zeros({2}, x.options().dtype(at::kInt));
  }

  struct PairHash {
    size_t operator()(const std::pair<int64_t, uint64_t>& p) const {
      return std::hash<int64_t>()(p.first) * 31 + std::hash<uint64_t>()(p.second);
    }
  };

  int64_t kept_, sync_kept_, taken_ = 0, kept_taken_ = 0;
  std::string kept_error_;
  std::unordered_map<Key, Plan, KeyHash> plans_;
  std::unordered_map<std::pair<int64_t, uint64_t>, at::Tensor, PairHash> syncs_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Table>(m, "Table")
      .def(py::init<int64_t, int64_t>())
      .def("run", &Table::run)
      .def("add", &Table::add)
      .def("size", &Table::size)
      .def("taken", &Table::taken)
      .def("kept_taken", &Table::kept_taken)
      .def("kept_error", &Table::kept_error)
      .def("sync_for", &Table::sync_for)
      .def_static("param_sizes", &Table::param_sizes);
  m.def("driver_missing", []() { return driver().missing; });
  m.def("cublaslt_missing", []() { return lt().missing; });
  m.def("cublas_missing", []() { return cublas().missing; });
}
