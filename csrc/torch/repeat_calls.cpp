// The repeat-call tables of distgemm.gemm (16-bit without scales; float8 with per-tensor or
// row-wise scales) and distgemm.grouped_mm (forward and dgrad, no out): the key of a call whose checks passed and whose
// choice is settled -> what that choice runs (the vendor call through ATen: F.linear, addmm, torch._scaled_mm or
// torch._grouped_mm; or one of our tile configurations through the dispatcher). One call from Python reads the key off
// the tensors, finds the entry and runs it, so that a repeated call costs no more host time than the vendor call made
// from Python (python/distgemm/_repeat_calls.py sets this up; dense.py and grouped.py fill it).
//
// One build serves any CPython: this file uses the stable ABI of Py_LIMITED_API 3.10 only (the
// object header, reference counts and functions every later CPython with a GIL keeps, as for an
// abi3 extension: a Python 3.11 build runs on 3.12), and takes the Python symbols of the running
// interpreter at load time, as torch's own libraries do. Free-threaded CPythons have another
// object header: Python leaves the tables out there. Of torch it uses what libtorch_python
// exports to its bindings, declared below (their headers need the full, version-specific C API),
// and the layout of its tensor object, checked when the tables are made.
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <unordered_map>

// torch/csrc/autograd/python_variable.h, torch/csrc/DynamicTypes.h, torch/csrc/Exceptions.h.
struct THPDtype;
extern PyObject* THPVariableClass;
extern PyObject* ParameterClass;
PyObject* THPVariable_Wrap(at::TensorBase&& var);
namespace torch {
THPDtype* getTHPDtype(at::ScalarType scalar_type);
void translate_exception_to_python(const std::exception_ptr& error);
}  // namespace torch

namespace distgemm::torch_binding {
namespace {

// torch's Python tensor object (THPVariable): the object header, then the tensor.
struct TensorObject {
  PyObject ob_base;
  at::Tensor tensor;
};

const at::Tensor& tensor_of(PyObject* obj) { return reinterpret_cast<TensorObject*>(obj)->tensor; }

// A torch.Tensor or nn.Parameter, not another subclass (whose __torch_function__ the vendor call
// made here would skip).
bool is_plain_tensor(PyObject* obj) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  return type == THPVariableClass || (ParameterClass != nullptr && type == ParameterClass);
}

// A key: per tensor its dim, dtype and device in one word, then its sizes and strides; then the
// op's other arguments and the settings in force.
constexpr int kMaxDim = 3;  // the operands of the remembered calls are 0-D (scales) to 3-D
constexpr int kTensorWords = 1 + 2 * kMaxDim;
constexpr int kScalarWords = 5;
template <int kTensors>
using KeyOf = std::array<int64_t, kTensors * kTensorWords + kScalarWords>;
using Key = KeyOf<3>;        // gemm (a, b, c) and grouped_mm (x, w, offs)
using ScaledKey = KeyOf<5>;  // a scaled gemm (a, b, c, scale_a, scale_b)

struct KeyHash {
  template <class K>
  size_t operator()(const K& key) const {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int64_t word : key) h = (h ^ static_cast<uint64_t>(word)) * 0x100000001b3ull;
    return static_cast<size_t>(h);
  }
};

// t's words of a key (tensor `index` of the call; t null: None). False where no remembered call
// can have such an operand. May throw (a tensor without sizes or strides): the caller's miss.
template <class K>
bool put_tensor(K* key, int index, const at::Tensor* t) {
  int64_t* words = key->data() + index * kTensorWords;
  if (t == nullptr) {
    words[0] = -1;
    return true;
  }
  if (t->layout() != at::kStrided || t->is_nested() || t->dim() > kMaxDim) return false;
  const int64_t dim = t->dim();
  const at::Device device = t->device();
  words[0] = dim | static_cast<int64_t>(t->scalar_type()) << 8 | static_cast<int64_t>(device.type()) << 16 |
             static_cast<int64_t>(static_cast<uint8_t>(device.index())) << 24;
  const auto sizes = t->sizes();
  const auto strides = t->strides();
  for (int64_t i = 0; i < dim; ++i) {
    words[1 + i] = sizes[i];
    words[1 + kMaxDim + i] = strides[i];
  }
  return true;
}

template <class K>
int64_t& scalar_word(K* key, int i) {
  return (*key)[key->size() - kScalarWords + i];
}

// What a remembered call runs.
struct Run {
  int64_t config = -1;  // one of our tile configurations, or -1: the vendor call
  at::ScalarType out_dtype = at::kFloat;
  double alpha = 1.0, beta = 0.0;            // gemm
  int64_t n = 0;                             // grouped_mm: the output's columns; scaled gemm: b's rows
  bool trans_w = true;                       // grouped_mm
  int64_t m = 0;                             // scaled gemm: a's rows
  at::ScalarType kernel_dtype = at::kFloat;  // scaled gemm, our kernel: what it writes (cast to out_dtype)
  bool fast_accum = false;                   // scaled gemm: the accumulation it runs
  bool row_wise = false;                     // scaled gemm, torch._scaled_mm: the scales' forms
  PyObject* name = nullptr;                  // what autotune.last_backend() reports then (owned)
};

// The calls of one op. Every use holds the GIL: the Python calls below are its only users, and a
// repeated call copies its entry before it lets the GIL go.
template <class Key>
class Table {
 public:
  explicit Table(size_t limit) : limit_(limit) {}

  const Run* find(const Key& key) const {
    const auto it = runs_.find(key);
    return it == runs_.end() ? nullptr : &it->second;
  }

  // Beyond `limit` keys the table starts again, so that dynamic shapes keep it bounded.
  void put(const Key& key, const Run& run) {
    if (runs_.size() >= limit_ && runs_.find(key) == runs_.end()) clear();
    Py_INCREF(run.name);
    auto [it, added] = runs_.try_emplace(key, run);
    if (!added) {
      Py_DECREF(it->second.name);
      it->second = run;
    }
  }

  void clear() {
    for (auto& entry : runs_) Py_DECREF(entry.second.name);
    runs_.clear();
  }

  bool empty() const { return runs_.empty(); }
  size_t size() const { return runs_.size(); }

 private:
  size_t limit_;
  std::unordered_map<Key, Run, KeyHash> runs_;
};

// The output dtypes a remembered call can have (16-bit inputs: theirs, or float32).
constexpr at::ScalarType kOutDtypes[] = {at::kBFloat16, at::kHalf, at::kFloat};

struct State {
  explicit State(size_t limit) : gemm(limit), grouped(limit), scaled(limit) {}
  Table<Key> gemm, grouped;
  Table<ScaledKey> scaled;
  PyObject* last_ran = nullptr;          // autotune's one-item list of what the last call ran
  PyObject* settings_globals = nullptr;  // distgemm._settings' globals: the settings in force are
  PyObject* settings_name = nullptr;     // its _current (equal settings are one object)
  PyObject* dtype_objects[std::size(kOutDtypes)] = {};
};

State* state = nullptr;  // made once, never freed (no GIL to release its names with at exit)

// A dtype object among kOutDtypes; false for any other object.
bool read_dtype(PyObject* obj, at::ScalarType* dtype) {
  for (size_t i = 0; i < std::size(kOutDtypes); ++i) {
    if (obj == state->dtype_objects[i]) {
      *dtype = kOutDtypes[i];
      return true;
    }
  }
  return false;
}

// alpha or beta as a key holds it: a plain float or int only (bool and NumPy's bool equal 1 and 0,
// which the checks refuse; other number types take the full path). NaN matches nothing; -0.0 is
// 0.0, as in a Python key.
bool read_real(PyObject* obj, double* value) {
  if (PyFloat_CheckExact(obj)) {
    *value = PyFloat_AsDouble(obj);
  } else if (PyLong_CheckExact(obj)) {
    *value = PyLong_AsDouble(obj);
    if (*value == -1.0 && PyErr_Occurred()) {  // beyond a double: no remembered call has it
      PyErr_Clear();
      return false;
    }
  } else {
    return false;
  }
  if (std::isnan(*value)) return false;
  if (*value == 0.0) *value = 0.0;
  return true;
}

int64_t bits_of(double value) {
  int64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

bool records_autograd(std::initializer_list<const at::Tensor*> operands) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : operands)
    if (t != nullptr && t->requires_grad()) return true;
  return false;
}

PyObject* current_settings() { return PyDict_GetItem(state->settings_globals, state->settings_name); }

// gemm(a, b, c, alpha, beta, out_dtype) as its key reads it.
struct GemmCall {
  const at::Tensor* a;
  const at::Tensor* b;
  const at::Tensor* c;  // null: None
  double alpha, beta;
  at::ScalarType out_dtype;  // None: a's
};

bool read_gemm(PyObject* const* args, GemmCall* call, bool scaled = false) {
  if (!is_plain_tensor(args[0]) || !is_plain_tensor(args[1]) || (args[2] != Py_None && !is_plain_tensor(args[2])))
    return false;
  call->a = &tensor_of(args[0]);
  call->b = &tensor_of(args[1]);
  call->c = args[2] == Py_None ? nullptr : &tensor_of(args[2]);
  if (!read_real(args[3], &call->alpha) || !read_real(args[4], &call->beta)) return false;
  if (args[5] == Py_None) {  // as the checks resolve it (for float8: bfloat16)
    call->out_dtype = scaled ? at::kBFloat16 : call->a->scalar_type();
    return true;
  }
  return read_dtype(args[5], &call->out_dtype);
}

bool gemm_key(const GemmCall& call, PyObject* settings, Key* key) {
  if (!put_tensor(key, 0, call.a) || !put_tensor(key, 1, call.b) || !put_tensor(key, 2, call.c)) return false;
  scalar_word(key, 0) = bits_of(call.alpha);
  scalar_word(key, 1) = bits_of(call.beta);
  scalar_word(key, 2) = static_cast<int64_t>(call.out_dtype);
  scalar_word(key, 3) = reinterpret_cast<intptr_t>(settings);
  return true;
}

// gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum) of a float8 call with
// scales as its key reads it.
struct ScaledCall {
  GemmCall gemm;
  const at::Tensor* scale_a;
  const at::Tensor* scale_b;
  bool fast_accum;
};

// True or False only: 1 and 1.0 equal True, and the checks refuse them.
bool read_flag(PyObject* obj, bool* flag) {
  if (obj != Py_True && obj != Py_False) return false;
  *flag = obj == Py_True;
  return true;
}

bool read_scaled(PyObject* const* args, ScaledCall* call) {
  if (!read_gemm(args, &call->gemm, /*scaled=*/true) || !is_plain_tensor(args[6]) || !is_plain_tensor(args[7]))
    return false;
  call->scale_a = &tensor_of(args[6]);
  call->scale_b = &tensor_of(args[7]);
  return read_flag(args[8], &call->fast_accum);
}

bool scaled_key(const ScaledCall& call, PyObject* settings, ScaledKey* key) {
  const GemmCall& g = call.gemm;
  if (!put_tensor(key, 0, g.a) || !put_tensor(key, 1, g.b) || !put_tensor(key, 2, g.c) ||
      !put_tensor(key, 3, call.scale_a) || !put_tensor(key, 4, call.scale_b))
    return false;
  scalar_word(key, 0) = bits_of(g.alpha);
  scalar_word(key, 1) = bits_of(g.beta);
  scalar_word(key, 2) = static_cast<int64_t>(g.out_dtype);
  scalar_word(key, 3) = reinterpret_cast<intptr_t>(settings);
  scalar_word(key, 4) = call.fast_accum;
  return true;
}

// grouped_mm(x, w, offs, out_dtype, trans_w) as its key reads it.
struct GroupedCall {
  const at::Tensor* x;
  const at::Tensor* w;
  const at::Tensor* offs;
  int64_t out_dtype;  // as passed: -1 for None (a key of its own, as in grouped.py)
  bool trans_w;
};

bool read_grouped(PyObject* const* args, GroupedCall* call) {
  if (!is_plain_tensor(args[0]) || !is_plain_tensor(args[1]) || !is_plain_tensor(args[2])) return false;
  call->x = &tensor_of(args[0]);
  call->w = &tensor_of(args[1]);
  call->offs = &tensor_of(args[2]);
  call->out_dtype = -1;
  at::ScalarType dtype;
  if (args[3] != Py_None) {
    if (!read_dtype(args[3], &dtype)) return false;
    call->out_dtype = static_cast<int64_t>(dtype);
  }
  return read_flag(args[4], &call->trans_w);
}

bool grouped_key(const GroupedCall& call, PyObject* settings, Key* key) {
  // The kernels' TMA reads x and w 16-byte aligned: another call copies them, and is not remembered.
  const auto x_ptr = reinterpret_cast<uintptr_t>(call.x->const_data_ptr());
  const auto w_ptr = reinterpret_cast<uintptr_t>(call.w->const_data_ptr());
  if ((x_ptr | w_ptr) % 16 != 0) return false;
  if (!put_tensor(key, 0, call.x) || !put_tensor(key, 1, call.w) || !put_tensor(key, 2, call.offs)) return false;
  scalar_word(key, 0) = call.out_dtype;
  scalar_word(key, 1) = call.trans_w;
  scalar_word(key, 3) = reinterpret_cast<intptr_t>(settings);
  return true;
}

// The entry of a call, or null: a call no entry answers. Reading the key may throw for tensors
// no remembered call has (no strides, symbolic sizes): a miss too.
template <class Key, class Call, class KeyReader>
const Run* find(const Table<Key>& table, const Call& call, KeyReader key_of) {
  PyObject* settings = current_settings();
  if (settings == nullptr) return nullptr;
  Key key{};
  try {
    if (!key_of(call, settings, &key)) return nullptr;
  } catch (const std::exception&) {
    return nullptr;
  }
  return table.find(key);
}

class GilReleased {
 public:
  GilReleased() : thread_(PyEval_SaveThread()) {}
  ~GilReleased() { PyEval_RestoreThread(thread_); }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* thread_;
};

// Runs `compute` on a copy of the entry (another thread may clear the table while the GIL is
// released, as torch's bindings release it around an op) and returns its tensor, recording the
// entry's name as what the call ran; a C++ error becomes the Python exception torch raises.
// `compute` holds its own references to the operands, taken and dropped with the GIL held, as
// torch's bindings take theirs: a tensor that C++ shares keeps its Python object alive, which
// needs the GIL each time the sharing starts or stops (views made inside the op otherwise would).
template <class Compute>
PyObject* run_entry(const Run run, Compute compute) {
  PyObject* name = run.name;
  Py_INCREF(name);
  try {
    at::Tensor out;
    {
      GilReleased released;
      out = compute(run);
    }
    PyList_SetItem(state->last_ran, 0, name);  // takes the reference
    return THPVariable_Wrap(std::move(out));
  } catch (...) {
    Py_DECREF(name);
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

const auto& gemm_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("distgemm::gemm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               double, double, at::ScalarType, const std::optional<at::Tensor>&,
                                               const std::optional<at::Tensor>&, bool, int64_t, int64_t)>();
  return op;
}

const auto& grouped_mm_out_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("distgemm::grouped_mm_out", "")
                             .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         bool, bool, int64_t, int64_t)>();
  return op;
}

at::Tensor run_gemm(const Run& run, const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& c) {
  if (run.config < 0) {
    // cuBLAS as dense._cublas_gemm calls it; F.linear and addmm follow autocast, gemm does not.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    if (!c) return at::linear(a, b);
    return at::addmm(c->to(run.out_dtype), a, b.t());
  }
  return gemm_op().call(a, b, std::nullopt, run.alpha, run.beta, run.out_dtype, std::nullopt, std::nullopt, false,
                        run.config, 0);
}

at::Tensor run_grouped(const Run& run, const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  if (run.config < 0) {  // w.mT: torch._grouped_mm's (G, K, N) view of w
    return at::_grouped_mm(x, run.trans_w ? w.mT() : w, offs, std::nullopt, run.out_dtype);
  }
  at::Tensor out = at::empty({x.size(0), run.n}, x.options().dtype(run.out_dtype));
  grouped_mm_out_op().call(x, w, offs, out, false, run.trans_w, /*backend=cutlass*/ 0, run.config);
  return out;
}

// A scale as our kernels read it (dense._flat): 1-D, contiguous and 16-byte aligned.
at::Tensor flat_scale(const at::Tensor& scale) {
  at::Tensor flat = scale.reshape({-1}).contiguous();
  return reinterpret_cast<uintptr_t>(flat.const_data_ptr()) % 16 == 0 ? flat : flat.clone();
}

// A scale in torch._scaled_mm's form (dense._scaled_mm_runner): 0-D per tensor; row-wise
// (rows, cols) contiguous, one value expanded.
at::Tensor scaled_mm_scale(const at::Tensor& scale, bool row_wise, int64_t rows, int64_t cols) {
  if (!row_wise) return scale.reshape({});
  return (scale.numel() == 1 ? scale.reshape({1, 1}).expand({rows, cols}) : scale.reshape({rows, cols})).contiguous();
}

at::Tensor run_scaled(const Run& run, const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& c,
                      const at::Tensor& scale_a, const at::Tensor& scale_b) {
  if (run.config < 0) {  // torch._scaled_mm as dense._scaled_mm_runner calls it
    std::optional<at::Tensor> bias;
    if (c) bias = c->reshape({-1}).to(run.out_dtype);
    return at::_scaled_mm(a, b.t(), scaled_mm_scale(scale_a, run.row_wise, run.m, 1),
                          scaled_mm_scale(scale_b, run.row_wise, 1, run.n), bias, /*scale_result=*/std::nullopt,
                          run.out_dtype, run.fast_accum);
  }
  // dense._config_runner: the operands read in place (b unpadded: the output has b's rows).
  at::Tensor out = gemm_op().call(a, b, c, run.alpha, run.beta, run.kernel_dtype, flat_scale(scale_a),
                                  flat_scale(scale_b), run.fast_accum, run.config, 0);
  return run.kernel_dtype == run.out_dtype ? out : out.to(run.out_dtype);
}

bool takes_args(const char* name, Py_ssize_t nargs, Py_ssize_t expected) {
  if (nargs == expected) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, expected, nargs);
  return false;
}

// gemm(a, b, c, alpha, beta, out_dtype): the result of a remembered call, or None (the full path).
PyObject* repeat_gemm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes_args("gemm", nargs, 6)) return nullptr;
  GemmCall call;
  if (state->gemm.empty() || at::impl::torch_function_mode_enabled() || !read_gemm(args, &call) ||
      records_autograd({call.a, call.b, call.c}))
    Py_RETURN_NONE;
  const Run* run = find(state->gemm, call, gemm_key);
  if (run == nullptr) Py_RETURN_NONE;
  std::optional<at::Tensor> c;
  if (call.c != nullptr) c = *call.c;
  return run_entry(*run, [a = *call.a, b = *call.b, c = std::move(c)](const Run& r) { return run_gemm(r, a, b, c); });
}

// scaled_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum): the same for a
// float8 call with per-tensor or row-wise scales.
PyObject* repeat_scaled_gemm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes_args("scaled_gemm", nargs, 9)) return nullptr;
  ScaledCall call;
  if (state->scaled.empty() || at::impl::torch_function_mode_enabled() || !read_scaled(args, &call) ||
      records_autograd({call.gemm.a, call.gemm.b, call.gemm.c, call.scale_a, call.scale_b}))
    Py_RETURN_NONE;
  const Run* run = find(state->scaled, call, scaled_key);
  if (run == nullptr) Py_RETURN_NONE;
  std::optional<at::Tensor> c;
  if (call.gemm.c != nullptr) c = *call.gemm.c;
  return run_entry(*run, [a = *call.gemm.a, b = *call.gemm.b, c = std::move(c), sa = *call.scale_a,
                          sb = *call.scale_b](const Run& r) { return run_scaled(r, a, b, c, sa, sb); });
}

// grouped_mm(x, w, offs, out_dtype, trans_w): the same for a grouped call.
PyObject* repeat_grouped_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes_args("grouped_mm", nargs, 5)) return nullptr;
  GroupedCall call;
  if (state->grouped.empty() || at::impl::torch_function_mode_enabled() || !read_grouped(args, &call) ||
      records_autograd({call.x, call.w}))
    Py_RETURN_NONE;
  const Run* run = find(state->grouped, call, grouped_key);
  if (run == nullptr) Py_RETURN_NONE;
  return run_entry(*run,
                   [x = *call.x, w = *call.w, offs = *call.offs](const Run& r) { return run_grouped(r, x, w, offs); });
}

// The entry's name and configuration, from remember_*'s last two arguments.
bool read_run(PyObject* name, PyObject* config, Run* run) {
  if (!PyUnicode_Check(name) || !PyLong_Check(config)) {
    PyErr_SetString(PyExc_TypeError, "a repeat call's name must be a str and its config an int");
    return false;
  }
  run->name = name;
  run->config = PyLong_AsLongLong(config);
  return !(run->config == -1 && PyErr_Occurred());
}

// Puts `run` in `table` under the key of the call in `args` (read by `read`, keyed by `key_of`),
// once `complete(call, &run)` has filled in what the entry takes from the call (false: not
// remembered). Operands a repeated call would not take (another subclass) are not remembered; a
// C++ error becomes the Python exception torch raises.
template <class Call, class K, class Reader, class KeyReader, class Complete>
PyObject* remember(Table<K>* table, PyObject* const* args, Run run, Reader read, KeyReader key_of, Complete complete) {
  Call call;
  K key{};
  PyObject* settings = current_settings();
  if (settings == nullptr || !read(args, &call)) Py_RETURN_NONE;
  try {
    if (!key_of(call, settings, &key) || !complete(call, &run)) Py_RETURN_NONE;
  } catch (...) {
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
  table->put(key, run);
  Py_RETURN_NONE;
}

// remember_gemm(a, b, c, alpha, beta, out_dtype, name, config): later calls of this key run
// `config` (-1: cuBLAS through PyTorch) and report `name`.
PyObject* remember_gemm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes_args("remember_gemm", nargs, 8)) return nullptr;
  Run run;
  if (!read_run(args[6], args[7], &run)) return nullptr;
  return remember<GemmCall>(
      &state->gemm, args, run, [](PyObject* const* a, GemmCall* call) { return read_gemm(a, call); }, gemm_key,
      [](const GemmCall& call, Run* r) {
        r->alpha = call.alpha;
        r->beta = call.beta;
        r->out_dtype = call.out_dtype;
        return true;
      });
}

// remember_grouped_mm(x, w, offs, out_dtype, trans_w, kernel_out_dtype, name, config): the same
// for a grouped call (`out_dtype` as passed, `kernel_out_dtype` the one it resolves to; config
// -1: torch._grouped_mm).
PyObject* remember_grouped_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes_args("remember_grouped_mm", nargs, 8)) return nullptr;
  Run run;
  if (!read_run(args[6], args[7], &run)) return nullptr;
  if (!read_dtype(args[5], &run.out_dtype)) {
    PyErr_SetString(PyExc_TypeError, "remember_grouped_mm: kernel_out_dtype must be bfloat16, float16 or float32");
    return nullptr;
  }
  return remember<GroupedCall>(&state->grouped, args, run, read_grouped, grouped_key,
                               [](const GroupedCall& call, Run* r) {
                                 if (call.w->dim() != 3) return false;
                                 r->n = call.w->size(call.trans_w ? 1 : 2);
                                 r->trans_w = call.trans_w;
                                 return true;
                               });
}

// remember_scaled_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum,
// kernel_dtype, kernel_fast_accum, name, config): the same for a float8 call with per-tensor or
// row-wise scales (config -1: torch._scaled_mm, run with kernel_fast_accum; else our kernel, in
// kernel_dtype, on the operands in place).
PyObject* remember_scaled_gemm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!takes_args("remember_scaled_gemm", nargs, 13)) return nullptr;
  Run run;
  if (!read_run(args[11], args[12], &run)) return nullptr;
  if (!read_dtype(args[9], &run.kernel_dtype) || !read_flag(args[10], &run.fast_accum)) {
    PyErr_SetString(PyExc_TypeError,
                    "remember_scaled_gemm: kernel_dtype must be bfloat16, float16 or float32 and "
                    "kernel_fast_accum a bool");
    return nullptr;
  }
  return remember<ScaledCall>(&state->scaled, args, run, read_scaled, scaled_key, [](const ScaledCall& call, Run* r) {
    const GemmCall& g = call.gemm;
    if (g.a->dim() != 2 || g.b->dim() != 2) return false;
    r->m = g.a->size(0);
    r->n = g.b->size(0);
    r->row_wise = call.scale_a->numel() > 1 || call.scale_b->numel() > 1;  // dense._row_wise
    r->alpha = g.alpha;
    r->beta = g.beta;
    r->out_dtype = g.out_dtype;
    return true;
  });
}

PyObject* clear(PyObject*, PyObject*) {
  state->gemm.clear();
  state->grouped.clear();
  state->scaled.clear();
  Py_RETURN_NONE;
}

PyObject* sizes(PyObject*, PyObject*) {
  return Py_BuildValue("(nnn)", static_cast<Py_ssize_t>(state->gemm.size()),
                       static_cast<Py_ssize_t>(state->grouped.size()), static_cast<Py_ssize_t>(state->scaled.size()));
}

PyMethodDef functions[] = {
    {"gemm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(repeat_gemm)), METH_FASTCALL,
     "gemm(a, b, c, alpha, beta, out_dtype): a remembered call's result, or None"},
    {"grouped_mm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(repeat_grouped_mm)), METH_FASTCALL,
     "grouped_mm(x, w, offs, out_dtype, trans_w): a remembered call's result, or None"},
    {"scaled_gemm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(repeat_scaled_gemm)), METH_FASTCALL,
     "scaled_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum): a remembered call's "
     "result, or None"},
    {"remember_gemm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(remember_gemm)), METH_FASTCALL,
     "remember_gemm(a, b, c, alpha, beta, out_dtype, name, config)"},
    {"remember_grouped_mm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(remember_grouped_mm)),
     METH_FASTCALL, "remember_grouped_mm(x, w, offs, out_dtype, trans_w, kernel_out_dtype, name, config)"},
    {"remember_scaled_gemm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(remember_scaled_gemm)),
     METH_FASTCALL,
     "remember_scaled_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum, kernel_dtype, "
     "kernel_fast_accum, name, config)"},
    {"clear", clear, METH_NOARGS, "clear(): forgets every remembered call"},
    {"sizes", sizes, METH_NOARGS, "sizes(): the number of remembered gemm, grouped_mm and scaled gemm calls"},
};

// Whether tensor_of reads torch's tensor objects right: a tensor made here, wrapped by torch, is
// read back.
bool tensor_layout_matches() {
  const at::Tensor probe = at::empty({2, 3});
  PyObject* wrapped = THPVariable_Wrap(at::Tensor(probe));
  if (wrapped == nullptr) return false;
  const bool matches =
      is_plain_tensor(wrapped) && tensor_of(wrapped).unsafeGetTensorImpl() == probe.unsafeGetTensorImpl();
  Py_DECREF(wrapped);
  return matches;
}

}  // namespace
}  // namespace distgemm::torch_binding

// Called once by distgemm._repeat_calls (through ctypes, the GIL held): makes the tables and
// returns their functions (gemm, grouped_mm, scaled_gemm, remember_gemm, remember_grouped_mm,
// remember_scaled_gemm, clear, sizes).
// last_ran: autotune's one-item list of what the last call ran; settings_globals:
// distgemm._settings' globals; limit: the keys a table holds before it starts again.
extern "C" __attribute__((visibility("default"))) PyObject* distgemm_repeat_calls(PyObject* last_ran,
                                                                                  PyObject* settings_globals,
                                                                                  Py_ssize_t limit) {
  using namespace distgemm::torch_binding;
  if (state != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "distgemm's repeat-call tables are made once");
    return nullptr;
  }
  if (!PyList_Check(last_ran) || PyList_Size(last_ran) != 1 || !PyDict_Check(settings_globals) || limit < 1) {
    PyErr_SetString(PyExc_TypeError, "distgemm_repeat_calls(last_ran: one-item list, settings_globals: dict, limit)");
    return nullptr;
  }
  PyObject* settings_name = PyUnicode_InternFromString("_current");
  if (settings_name == nullptr) return nullptr;
  if (PyDict_GetItem(settings_globals, settings_name) == nullptr) {
    Py_DECREF(settings_name);
    PyErr_SetString(PyExc_RuntimeError, "distgemm._settings has no _current settings");
    return nullptr;
  }
  try {
    if (!tensor_layout_matches()) {
      Py_DECREF(settings_name);
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ImportError,
                        "distgemm: torch's tensor objects differ from the headers this binding was built against; "
                        "reinstall distgemm against the installed torch");
      return nullptr;
    }
    auto* made = new State(static_cast<size_t>(limit));
    for (size_t i = 0; i < std::size(kOutDtypes); ++i)
      made->dtype_objects[i] = reinterpret_cast<PyObject*>(torch::getTHPDtype(kOutDtypes[i]));
    Py_INCREF(last_ran);
    Py_INCREF(settings_globals);
    made->last_ran = last_ran;
    made->settings_globals = settings_globals;
    made->settings_name = settings_name;
    state = made;
  } catch (...) {
    Py_DECREF(settings_name);
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
  const Py_ssize_t count = static_cast<Py_ssize_t>(std::size(functions));
  PyObject* result = PyTuple_New(count);
  if (result == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* fn = PyCFunction_NewEx(&functions[i], nullptr, nullptr);
    if (fn == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SetItem(result, i, fn);
  }
  return result;
}
