// The decode GEMM's eager call in C++: per call shape, the Triton launches that the Python path
// (kernels_fused/hopper/decode.py) found, replayed from one call (key, allocations, argument
// packing, driver launch) instead of a dozen Python steps. Built and described by
// kernels_fused/hopper/native.py; a call it cannot take returns None and the Python path runs.
//
// Built against torch's CPU headers only: the CUDA driver is reached through dlopen, the stream
// comes from the caller, so no CUDA toolkit is needed to build it (and CI builds it on a CPU).
#include <torch/extension.h>

#include <dlfcn.h>

#include <array>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
constexpr CUresult kSuccess = 0;
constexpr CUresult kCooperativeTooLarge = 720;  // CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
constexpr CUresult kNotSupported = 801;         // CUDA_ERROR_NOT_SUPPORTED (an SM share refuses)

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
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);  // torch has loaded it where there is a GPU
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (lib == nullptr) {
      missing = "libcuda.so.1 cannot be loaded";
      return;
    }
    bind(lib, launch, "cuLaunchKernel");
    bind(lib, launch_cooperative, "cuLaunchCooperativeKernel");
    bind(lib, is_capturing, "cuStreamIsCapturing");
    bind(lib, ctx_device, "cuCtxGetDevice");
    bind(lib, param_info, "cuFuncGetParamInfo");  // CUDA 12.4+: the plans are checked against it
    bind(lib, error_string, "cuGetErrorString");
  }

  template <typename F>
  void bind(void* lib, F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    if (f == nullptr && missing.empty()) missing = std::string("the driver has no ") + name;
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

// A kernel parameter: a pointer taken per call (ROLE), or 4 / 8 bytes fixed per call shape.
enum Kind : int64_t { kPointer = 0, kBits32 = 1, kBits64 = 2 };
// Which pointer: the call's tensors, the scratch (plus a byte offset), the stream's wait counter,
// none (Triton's global and profile scratch, unused by these kernels), or a vendor plan's M-major
// activation scales (its scratch holds the quantized rows).
enum Role : int64_t {
  kX = 0, kW = 1, kScale = 2, kBiasOrOut = 3, kOut = 4, kScratch = 5, kSync = 6, kNull = 7, kAScale = 8
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
  // zero-padded rows, then cuBLAS's blockwise GEMM (vendor_gemm below)
  int64_t vendor_rows = 0;
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

// decode.py's vendor_gemm, call for call: out [..., n] = (q @ dequant(w).T)[:m, :n] (+ bias).
void vendor_gemm(const at::Tensor& q, const at::Tensor& sa, const at::Tensor& w, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t m, int64_t n) {
  at::Tensor rows = out.view({m, n});
  if (q.size(0) == m && w.size(0) == n) {
    at::_scaled_mm_out(rows, q, w.t(), sa, scale.t(), std::nullopt, std::nullopt, at::kBFloat16, false);
  } else {
    rows.copy_(at::_scaled_mm(q, w.t(), sa, scale.t(), std::nullopt, std::nullopt, at::kBFloat16, false)
                   .narrow(0, 0, m)
                   .narrow(1, 0, n));
  }
  if (bias.has_value() && bias->defined()) out.add_(*bias);
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
  // message where it refused the one launch; the plan is dropped then).
  py::object run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                 const std::optional<at::Tensor>& bias, int64_t n, int64_t quant, bool one, uint64_t stream) {
    Key key;
    if (!key_of(x, w, scale, bias, n, quant, key)) return py::none();
    auto it = plans_.find(key);
    if (it == plans_.end()) return py::none();
    const Driver& d = driver();
    if (!d.missing.empty()) return py::none();
    int current = -1;
    if (d.ctx_device(&current) != kSuccess || current != x.get_device()) return py::none();
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
    at::Tensor q, sa;  // a vendor plan's quantized rows and their M-major scales, as decode.py allocates them
    if (plan.vendor_rows > 0) {
      const int64_t k_padded = w.size(1);
      q = at::empty({plan.vendor_rows, k_padded}, x.options().dtype(at::kFloat8_e4m3fn));
      sa = at::empty({k_padded / kScaleBlock, plan.vendor_rows}, x.options().dtype(at::kFloat)).t();
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
    if (plan.vendor_rows > 0) vendor_gemm(q, sa, w, scale, bias, out, key[0], n);
    ++taken_;
    return py::cast(out);
  }

  // How many calls this table took (tests: a call that should take it did).
  int64_t taken() const { return taken_; }

  // The wait's counter of x's device and ``stream`` (tests: the one launch counted).
  at::Tensor sync_for(const at::Tensor& x, uint64_t stream) { return sync_of(x, stream); }

  // Keep the plan of the call (x, w, scale, bias, n, quant) (its key computed as run computes it).
  // one / two: per launch (function, (gx, gy, gz), threads, shared bytes, cooperative,
  // [(kind, value, offset), ...]); each is checked against the function's parameters as the driver
  // reports them, and a plan that disagrees is refused (ValueError, nothing kept).
  void add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
           int64_t n, int64_t quant, const py::list& one, const py::list& two, int64_t scratch_one,
           int64_t scratch_two, int64_t vendor_rows, py::object keep) {
    Key key;
    if (!key_of(x, w, scale, bias, n, quant, key)) throw py::value_error("decode_calls: this call cannot be planned");
    Plan plan;
    plan.one = launches_of(one);
    plan.two = launches_of(two);
    plan.scratch_one = scratch_one;
    plan.scratch_two = scratch_two;
    plan.vendor_rows = vendor_rows;
    if (vendor_rows > 0 && (!plan.one.empty() || w.size(1) % kScaleBlock != 0))
      throw py::value_error("decode_calls: a vendor plan has the quantizer's launch alone, over K a multiple of 128");
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
  static constexpr size_t kRoles = 9;
  static constexpr int64_t kScaleBlock = 128;  // blockscale's activation scale group
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

  int64_t kept_, sync_kept_, taken_ = 0;
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
      .def("sync_for", &Table::sync_for)
      .def_static("param_sizes", &Table::param_sizes);
  m.def("driver_missing", []() { return driver().missing; });
}
