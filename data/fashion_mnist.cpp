#include "data/fashion_mnist.h"

#include <filesystem>

#include "core/error.h"
#include "data/idx.h"
#include "kernels/kernels.h"

namespace nanoddp::data {

namespace {

// root/name.gz if it exists, else root/name if it exists; otherwise an IOError that says
// where we looked and how to get the files (or that root is not a folder).
std::string find_file(const std::string& root, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path gz = fs::path(root) / (name + ".gz");
  const fs::path raw = fs::path(root) / name;
  std::error_code ignored;
  if (fs::exists(gz, ignored)) return gz.string();
  if (fs::exists(raw, ignored)) return raw.string();
  NANODDP_CHECK(!fs::exists(root, ignored) || fs::is_directory(root, ignored), IOError, "Fashion-MNIST: '",
                root, "' is a file, not a folder: pass the folder that holds the four IDX files (default ",
                FashionMNIST::kDefaultRoot, ")");
  NANODDP_THROW(IOError, "Fashion-MNIST file not found: '", gz.string(), "' (nor '", raw.string(),
                "'). Install Debian's package with `apt-get install dataset-fashion-mnist` (files in ",
                FashionMNIST::kDefaultRoot, ") or pass the folder that holds the four IDX files");
}

}  // namespace

FashionMNIST::FashionMNIST(const std::string& root, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = find_file(root, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(root, prefix + "-labels-idx1-ubyte");
  images_ = read_idx_images(images_path);
  labels_ = read_idx_labels(labels_path);

  NANODDP_CHECK(images_.size(1) == kRows && images_.size(2) == kCols, IOError, "Fashion-MNIST file '",
                images_path, "': images are ", images_.size(1), "x", images_.size(2), ", expected ", kRows,
                "x", kCols);
  NANODDP_CHECK(images_.size(0) == labels_.size(0), IOError, "Fashion-MNIST: '", images_path, "' holds ",
                images_.size(0), " images but '", labels_path, "' holds ", labels_.size(0), " labels");
  const int64_t* labels = labels_.numel() > 0 ? labels_.data<int64_t>() : nullptr;
  for (int64_t i = 0; i < labels_.numel(); ++i) {
    // Label i sits at byte 8 + i of the label file (after its 8-byte header).
    NANODDP_CHECK(labels[i] >= 0 && labels[i] < kClasses, IOError, "Fashion-MNIST file '", labels_path,
                  "': label ", labels[i], " at byte offset ", 8 + i, " is outside [0, ", kClasses, ")");
  }
}

Example FashionMNIST::get(int64_t index) const {
  NANODDP_CHECK(index >= 0 && index < size(), IndexError, "FashionMNIST: index ", index,
                " is out of range for ", size(), " examples");
  Tensor input = Tensor::empty({kFeatures});
  kernels::cpu::bytes_to_unit_float(input.data<float>(), images_.data<uint8_t>() + index * kFeatures,
                                    kFeatures);
  Tensor target = Tensor::empty({}, DType::Int64);
  *target.data<int64_t>() = labels_.data<int64_t>()[index];
  return {input, target};
}

Batch FashionMNIST::get_batch(const std::vector<int64_t>& indices) const {
  NANODDP_CHECK(!indices.empty(), ValueError, "FashionMNIST::get_batch: no indices");
  const auto B = static_cast<int64_t>(indices.size());
  const Tensor bytes = detail::gather_rows(images_, indices, "FashionMNIST");  // uint8 [B, 28, 28]
  Tensor input = Tensor::empty({B, kFeatures});
  kernels::cpu::bytes_to_unit_float(input.data<float>(), bytes.data<uint8_t>(), B * kFeatures);
  return {input, detail::gather_rows(labels_, indices, "FashionMNIST")};
}

}  // namespace nanoddp::data
