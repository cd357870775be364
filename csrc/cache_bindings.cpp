// pagedkv._C.CacheManager, StepLayout and CacheFull: the torch-free cache core (csrc/cache/) seen
// from Python. Only ints, lists and tensors cross; the typed face is python/pagedkv/_C.pyi.
#include "cache_bindings.h"

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "cache/cache_manager.h"
#include "cache/errors.h"
#include "cache/step_metadata.h"

namespace py = pybind11;

namespace pagedkv {
namespace {

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
      .def(py::init<int32_t, int32_t, int32_t>(), py::arg("max_batch"), py::arg("max_tokens"),
           py::arg("max_blocks_per_seq"))
      .def_readonly("max_batch", &StepLayout::max_batch)
      .def_readonly("max_tokens", &StepLayout::max_tokens)
      .def_readonly("max_blocks_per_seq", &StepLayout::max_blocks_per_seq)
      .def_readonly("context_lens", &StepLayout::context_lens)
      .def_readonly("query_start_loc", &StepLayout::query_start_loc)
      .def_readonly("slot_mapping", &StepLayout::slot_mapping)
      .def_readonly("positions", &StepLayout::positions)
      .def_readonly("block_tables", &StepLayout::block_tables)
      .def_readonly("size", &StepLayout::size)
      .def("used_size", &StepLayout::used_size, py::arg("padded_batch"));

  py::class_<CacheManager>(m, "CacheManager")
      .def(py::init<int32_t, int32_t, int64_t, bool>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("max_seq_len"), py::arg("enable_prefix_caching") = true)
      .def("add_sequence",
           [](CacheManager& self, int64_t seq_id, const std::vector<int32_t>& tokens) {
             return self.add_sequence(seq_id, tokens);
           },
           py::arg("seq_id"), py::arg("token_ids"))
      .def("append_tokens",
           [](CacheManager& self, int64_t seq_id, const std::vector<int32_t>& tokens) {
             std::vector<BlockCopy> copies;
             self.append_tokens(seq_id, tokens, copies);
             return copies_to_list(copies);
           },
           py::arg("seq_id"), py::arg("token_ids"))
      .def("append_batch",
           [](CacheManager& self, const std::vector<int64_t>& seq_ids, const std::vector<int32_t>& tokens) {
             std::vector<BlockCopy> copies;
             self.append_batch(seq_ids, tokens, copies);
             return copies_to_list(copies);
           },
           py::arg("seq_ids"), py::arg("token_ids"))
      .def("fork", &CacheManager::fork, py::arg("parent_id"), py::arg("child_id"))
      .def("free", &CacheManager::free_sequence, py::arg("seq_id"))
      .def("blocks_needed_to_add",
           [](const CacheManager& self, const std::vector<int32_t>& tokens) {
             return self.blocks_needed_to_add(tokens);
           },
           py::arg("token_ids"))
      .def("blocks_needed_to_append",
           [](CacheManager& self, const std::vector<int64_t>& seq_ids, int64_t tokens_each) {
             return self.blocks_needed_to_append(seq_ids, tokens_each);
           },
           py::arg("seq_ids"), py::arg("num_tokens") = 1)
      .def("can_allocate", &CacheManager::can_allocate, py::arg("num_blocks"))
      .def("seq_len", [](const CacheManager& self, int64_t id) { return self.sequence(id).num_tokens; },
           py::arg("seq_id"))
      .def("block_table", [](const CacheManager& self, int64_t id) { return self.sequence(id).blocks; },
           py::arg("seq_id"))
      .def("__contains__", &CacheManager::contains, py::arg("seq_id"))
      .def("__len__", &CacheManager::num_sequences)
      .def("sequence_ids", &CacheManager::sequence_ids)
      .def("ref_count",
           [](const CacheManager& self, int32_t block) {
             const int32_t n = self.allocator().num_blocks();
             if (block < 0 || block >= n) {
               throw std::invalid_argument("pagedkv: block " + std::to_string(block) +
                                           " is not in [0, " + std::to_string(n) + ")");
             }
             return self.allocator().ref_count(block);
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
           [](CacheManager& self, const StepLayout& layout, const at::Tensor& buffer,
              const std::vector<int64_t>& seq_ids, const std::optional<std::vector<int32_t>>& query_lens,
              int32_t padded_batch) {
             const StepSizes s = build_step_metadata(
                 self, layout, seq_ids, query_lens ? std::span<const int32_t>(*query_lens) : std::span<const int32_t>(),
                 padded_batch, step_buffer_data(buffer, layout));
             return py::make_tuple(s.num_tokens, s.max_query_len, s.max_context_len);
           },
           py::arg("layout"), py::arg("buffer"), py::arg("seq_ids"), py::arg("query_lens"),
           py::arg("padded_batch"));
}

}  // namespace pagedkv
