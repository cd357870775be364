// pagedkv._C.CacheManager, StepLayout and CacheFull: the torch-free cache core (csrc/cache/) seen
// from Python. Only ints, lists and tensors cross; the typed face is python/pagedkv/_C.pyi.
#include "cache_bindings.h"

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <limits>
#include <string>
#include <vector>

#include "cache/cache_manager.h"
#include "cache/errors.h"
#include "cache/step_metadata.h"

namespace py = pybind11;

namespace pagedkv {
namespace {

// What an int argument may hold, for the messages: "int32" or "int64".
template <typename T>
constexpr const char* int_type_name() {
  return sizeof(T) == 4 ? "int32" : "int64";
}

// A Python int as T, never wrapped: an int T cannot hold is a ValueError naming the argument, its
// value and what is allowed (pybind11's own caster answers "incompatible function arguments"); a
// bool is a TypeError (True is no count or id), as is a non-int. Objects with __index__ pass.
template <typename T>
T int_arg(py::handle obj, const std::string& name, const char* allowed) {
  if (PyBool_Check(obj.ptr())) {
    throw py::type_error("pagedkv: " + name + " must be an int, got a bool (" +
                         std::string(py::str(obj)) + ")");
  }
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) {
    PyErr_Clear();
    throw py::type_error("pagedkv: " + name + " must be an int, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
    throw std::invalid_argument("pagedkv: " + name + " = " + std::string(py::str(index)) +
                                " does not fit in " + int_type_name<T>() + "; allowed: " + allowed);
  }
  return static_cast<T>(v);
}

// Sequence ids are any int64.
int64_t seq_id(py::handle obj, const char* name = "seq_id") {
  return int_arg<int64_t>(obj, name, "any int64 id, [-2^63, 2^63 - 1]");
}

// Id and token lists arrive by the hundred every decode step; pybind11's generic list caster
// spends ~30 ns an element on them, this C-API loop a few. Also takes a 1-D CPU integer tensor
// (e.g. the sampled tokens, without a .tolist()). Elements as int_arg: never wrapped, no bools.
template <typename T>
std::vector<T> read_ints(py::handle obj, const char* name) {
  std::vector<T> out;
  const auto refuse = [&](int64_t i, const std::string& value) {
    throw std::invalid_argument(std::string("pagedkv: ") + name + "[" + std::to_string(i) + "] = " + value +
                                " does not fit in " + int_type_name<T>());
  };
  const auto store = [&](int64_t i, long long v) {
    if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) refuse(i, std::to_string(v));
    out[i] = static_cast<T>(v);
  };
  if (THPVariable_Check(obj.ptr())) {
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    TORCH_CHECK(t.dim() == 1 && t.device().is_cpu() && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
                "pagedkv: ", name, " must be a list of ints or a 1-D CPU int32/int64 tensor, got a ",
                t.scalar_type(), " tensor of shape ", t.sizes(), " on ", t.device());
    const at::Tensor c = t.contiguous();
    out.resize(c.numel());
    for (int64_t i = 0; i < c.numel(); ++i) {
      store(i, c.scalar_type() == at::kInt ? c.data_ptr<int32_t>()[i] : c.data_ptr<int64_t>()[i]);
    }
    return out;
  }
  const std::string error = std::string("pagedkv: ") + name + " must be a list of ints or a 1-D CPU integer tensor";
  const py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), error.c_str()));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyBool_Check(items[i])) {
      throw py::type_error(std::string("pagedkv: ") + name + "[" + std::to_string(i) + "] is a bool; give ints");
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0) refuse(i, std::string(py::str(items[i])));
    store(i, v);
  }
  return out;
}

py::list copies_to_list(const std::vector<BlockCopy>& copies) {
  py::list out;
  for (const BlockCopy& c : copies) out.append(py::make_tuple(c.src, c.dst));
  return out;
}

int32_t* step_buffer_data(const at::Tensor& buffer, const StepLayout& layout) {
  TORCH_CHECK(buffer.scalar_type() == at::kInt && buffer.device().is_cpu() && buffer.is_contiguous() &&
                  buffer.numel() >= layout.size,
              "pagedkv: the step buffer must be a contiguous CPU int32 tensor of at least ",
              layout.size, " elements (StepLayout.size); got ", buffer.scalar_type(), " on ",
              buffer.device(), " with ", buffer.numel(), " elements");
  return buffer.data_ptr<int32_t>();
}

}  // namespace

void register_cache_bindings(py::module_& m) {
  py::register_exception<CacheFull>(m, "CacheFull", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const UnknownSequence& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  py::class_<StepLayout>(m, "StepLayout")
      .def(py::init([](py::handle max_batch, py::handle max_tokens, py::handle max_blocks_per_seq) {
             // One statement each: the first bad argument (in order) is the one named.
             const int32_t batch = int_arg<int32_t>(max_batch, "max_batch", "[1, 2^31 - 1]");
             const int32_t tokens = int_arg<int32_t>(max_tokens, "max_tokens", "[max_batch, 2^31 - 1]");
             return StepLayout(batch, tokens, int_arg<int32_t>(max_blocks_per_seq, "max_blocks_per_seq", "[1, 2^31 - 1]"));
           }),
           py::arg("max_batch"), py::arg("max_tokens"), py::arg("max_blocks_per_seq"))
      .def_readonly("max_batch", &StepLayout::max_batch)
      .def_readonly("max_tokens", &StepLayout::max_tokens)
      .def_readonly("max_blocks_per_seq", &StepLayout::max_blocks_per_seq)
      .def_readonly("context_lens", &StepLayout::context_lens)
      .def_readonly("query_start_loc", &StepLayout::query_start_loc)
      .def_readonly("slot_mapping", &StepLayout::slot_mapping)
      .def_readonly("positions", &StepLayout::positions)
      .def_readonly("block_tables", &StepLayout::block_tables)
      .def_readonly("size", &StepLayout::size)
      .def("used_size",
           [](const StepLayout& self, py::handle padded_batch) {
             return self.used_size(int_arg<int32_t>(padded_batch, "padded_batch", "[0, max_batch]"));
           },
           py::arg("padded_batch"));

  // Every count and id goes through int_arg / read_ints: an int past what C++ takes is a
  // ValueError here; one that fits is checked by the manager against the cache's real limits.
  py::class_<CacheManager>(m, "CacheManager")
      .def(py::init([](py::handle num_blocks, py::handle block_size, py::handle max_seq_len, bool prefix_caching) {
             const int32_t blocks = int_arg<int32_t>(num_blocks, "num_blocks", "[1, 2^31 - 1]");
             const int32_t size = int_arg<int32_t>(block_size, "block_size", "a power of two <= 2^30");
             return CacheManager(blocks, size, int_arg<int64_t>(max_seq_len, "max_seq_len", "[1, 2^31 - block_size]"),
                                 prefix_caching);
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::arg("max_seq_len"),
           py::arg("enable_prefix_caching") = true)
      .def("add_sequence",
           [](CacheManager& self, py::handle id, py::handle tokens) {
             return self.add_sequence(seq_id(id), read_ints<int32_t>(tokens, "token_ids"));
           },
           py::arg("seq_id"), py::arg("token_ids"))
      .def("append_tokens",
           [](CacheManager& self, py::handle id, py::handle tokens) {
             std::vector<BlockCopy> copies;
             self.append_tokens(seq_id(id), read_ints<int32_t>(tokens, "token_ids"), copies);
             return copies_to_list(copies);
           },
           py::arg("seq_id"), py::arg("token_ids"))
      .def("reserve",
           [](CacheManager& self, py::handle id, py::handle num_tokens) {
             const int64_t sid = seq_id(id);
             std::vector<BlockCopy> copies;
             self.reserve(sid, int_arg<int64_t>(num_tokens, "num_tokens", "[0, max_seq_len - its length]"), copies);
             return copies_to_list(copies);
           },
           py::arg("seq_id"), py::arg("num_tokens"))
      .def("name_reserved",
           [](CacheManager& self, py::handle id, py::handle tokens) {
             const int64_t sid = seq_id(id);
             self.name_reserved(sid, read_ints<int32_t>(tokens, "token_ids"));
           },
           py::arg("seq_id"), py::arg("token_ids"))
      .def("drop_cached", &CacheManager::drop_cached)
      .def("append_batch",
           [](CacheManager& self, py::handle seq_ids, py::handle tokens) {
             std::vector<BlockCopy> copies;
             const std::vector<int64_t> ids = read_ints<int64_t>(seq_ids, "seq_ids");
             self.append_batch(ids, read_ints<int32_t>(tokens, "token_ids"), copies);
             return copies_to_list(copies);
           },
           py::arg("seq_ids"), py::arg("token_ids"))
      .def("set_pending_tokens",
           [](CacheManager& self, py::handle seq_ids, py::handle tokens) {
             const std::vector<int64_t> ids = read_ints<int64_t>(seq_ids, "seq_ids");
             self.set_pending_tokens(ids, read_ints<int32_t>(tokens, "token_ids"));
           },
           py::arg("seq_ids"), py::arg("token_ids"))
      .def("truncate",
           [](CacheManager& self, py::handle id, py::handle num_tokens) {
             const int64_t sid = seq_id(id);
             self.truncate(sid, int_arg<int64_t>(num_tokens, "num_tokens", "[0, its length - 1]"));
           },
           py::arg("seq_id"), py::arg("num_tokens"))
      .def("release_out_of_window",
           [](CacheManager& self, py::handle seq_ids, py::handle window) {
             const std::vector<int64_t> ids = read_ints<int64_t>(seq_ids, "seq_ids");
             return self.release_out_of_window(ids, int_arg<int64_t>(window, "window", ">= 1"));
           },
           py::arg("seq_ids"), py::arg("window"))
      .def("released_blocks",
           [](const CacheManager& self, py::handle id) { return self.sequence(seq_id(id)).released; },
           py::arg("seq_id"))
      .def("fork",
           [](CacheManager& self, py::handle parent, py::handle child) {
             const int64_t parent_id = seq_id(parent, "parent_id");
             self.fork(parent_id, seq_id(child, "child_id"));
           },
           py::arg("parent_id"), py::arg("child_id"))
      .def("free",
           [](CacheManager& self, py::handle id, bool keep_cached) { self.free_sequence(seq_id(id), keep_cached); },
           py::arg("seq_id"), py::arg("keep_cached") = true)
      .def("blocks_needed_to_add",
           [](const CacheManager& self, py::handle tokens) {
             return self.blocks_needed_to_add(read_ints<int32_t>(tokens, "token_ids"));
           },
           py::arg("token_ids"))
      .def("blocks_needed_to_append",
           [](CacheManager& self, py::handle seq_ids, py::handle num_tokens) {
             const std::vector<int64_t> ids = read_ints<int64_t>(seq_ids, "seq_ids");
             return self.blocks_needed_to_append(ids, int_arg<int64_t>(num_tokens, "num_tokens", "[0, max_seq_len]"));
           },
           py::arg("seq_ids"), py::arg("num_tokens") = 1)
      .def("can_allocate",
           [](const CacheManager& self, py::handle num_blocks) {
             return self.can_allocate(int_arg<int64_t>(num_blocks, "num_blocks", "[0, 2^63 - 1]"));
           },
           py::arg("num_blocks"))
      .def("seq_len", [](const CacheManager& self, py::handle id) { return self.sequence(seq_id(id)).num_tokens; },
           py::arg("seq_id"))
      .def("block_table", [](const CacheManager& self, py::handle id) { return self.sequence(seq_id(id)).blocks; },
           py::arg("seq_id"))
      .def("__contains__",
           [](const CacheManager& self, py::handle id) {
             // An int past int64 names no sequence; a bool or a non-int is still a TypeError.
             if (!PyBool_Check(id.ptr()) && PyLong_Check(id.ptr())) {
               int overflow = 0;
               const long long v = PyLong_AsLongLongAndOverflow(id.ptr(), &overflow);
               if (overflow != 0) return false;
               return self.contains(v);
             }
             return self.contains(seq_id(id));
           },
           py::arg("seq_id"))
      .def("__len__", &CacheManager::num_sequences)
      .def("sequence_ids", &CacheManager::sequence_ids)
      .def("ref_count",
           [](const CacheManager& self, py::handle block_arg) {
             const int64_t block = int_arg<int64_t>(block_arg, "block", "[0, num_blocks)");
             const int32_t n = self.allocator().num_blocks();
             if (block < 0 || block >= n) {
               throw std::invalid_argument("pagedkv: block " + std::to_string(block) +
                                           " is not in [0, " + std::to_string(n) + ")");
             }
             return self.allocator().ref_count(static_cast<int32_t>(block));
           },
           py::arg("block"))
      .def("evictable_blocks", [](const CacheManager& self) { return self.allocator().evictable_blocks(); })
      .def_property_readonly("num_blocks", [](const CacheManager& self) { return self.allocator().num_blocks(); })
      .def_property_readonly("num_free_blocks", [](const CacheManager& self) { return self.allocator().num_free(); })
      .def_property_readonly("num_evictable_blocks",
                             [](const CacheManager& self) { return self.allocator().num_evictable(); })
      .def_property_readonly("block_size", &CacheManager::block_size)
      .def_property_readonly("max_seq_len", &CacheManager::max_seq_len)
      .def_property_readonly("max_blocks_per_seq", &CacheManager::max_blocks_per_seq)
      .def_property_readonly("enable_prefix_caching", &CacheManager::prefix_caching)
      .def("build_step",
           [](CacheManager& self, const StepLayout& layout, const at::Tensor& buffer, py::handle seq_ids,
              py::handle query_lens, py::handle padded_batch, py::handle pad_query_len) {
             const int32_t padded = int_arg<int32_t>(padded_batch, "padded_batch", "[the batch size, max_batch]");
             const int32_t pad_q = int_arg<int32_t>(pad_query_len, "pad_query_len", ">= 1");
             const std::vector<int32_t> lens =
                 query_lens.is_none() ? std::vector<int32_t>() : read_ints<int32_t>(query_lens, "query_lens");
             const std::vector<int64_t> ids = read_ints<int64_t>(seq_ids, "seq_ids");
             const StepSizes s =
                 build_step_metadata(self, layout, ids, lens, padded, step_buffer_data(buffer, layout), pad_q);
             return py::make_tuple(s.num_tokens, s.max_query_len, s.max_context_len);
           },
           py::arg("layout"), py::arg("buffer"), py::arg("seq_ids"), py::arg("query_lens"),
           py::arg("padded_batch"), py::arg("pad_query_len") = 1);
}

}  // namespace pagedkv
