// The IDX file format of MNIST and Fashion-MNIST, read (gzipped or raw) through zlib.
//
//   Tensor images = read_idx_images("train-images-idx3-ubyte.gz");   // uint8 [N, 28, 28]
//   Tensor labels = read_idx_labels("train-labels-idx1-ubyte.gz");   // int64 [N]
//   write_idx("small-idx1-ubyte.gz", bytes /*uint8 [K]*/, /*gzip=*/true);
//
// An IDX file is a big-endian header followed by the data, row-major:
//   byte 0-1  zero
//   byte 2    element type: 0x08 = unsigned byte (the only type MNIST-style files use)
//   byte 3    number of dimensions D
//   4 * D     the size of each dimension, uint32 big-endian
//   then      exactly the product of the sizes in bytes, and nothing after it
// so an image file starts with the magic 0x00000803 and a label file with 0x00000801.
//
// The reader trusts nothing in the header: it checks the magic, every size, and that the
// data holds exactly the bytes the header promises, no more and no less. Data is read in
// chunks as it arrives, so a corrupt header that promises terabytes costs no more memory than
// the file really holds. Every failure is an IOError that names the file and the byte offset
// (in the decompressed stream for a .gz file) where the problem starts.
#pragma once

#include <string>

#include "core/tensor.h"

namespace nanoddp::data {

// path: an IDX file with element type unsigned byte and `dims` dimensions (1 to 4), gzipped
// or raw (zlib tells them apart by content, not by name) -> uint8 tensor of the header's
// shape. Throws IOError when the file cannot be opened or read, the magic is not
// 0x000008<dims>, the gzip stream is corrupt, or the data is shorter or longer than the header
// says; ValueError when dims is outside [1, 4].
Tensor read_idx(const std::string& path, int dims);

// path: an IDX image file (magic 0x00000803) -> uint8 [N, rows, cols]. rows and cols must
// be positive (IOError otherwise); N may be 0. Errors as read_idx.
Tensor read_idx_images(const std::string& path);

// path: an IDX label file (magic 0x00000801) -> int64 [N] (torch.long, as torchvision's
// MNIST gives targets). Errors as read_idx.
Tensor read_idx_labels(const std::string& path);

// Writes data (uint8, 1 to 4 dimensions, on the CPU) as an IDX file of element type unsigned
// byte, gzip-compressed when gzip is true. Throws ValueError for another dtype, ShapeError for
// a scalar or a size that does not fit in uint32, IOError when the file cannot be written
// (written as checkpoints are, core/file_io.h's write_file_atomically: path holds the old
// file or the new one, never half of one, and a full disk or the file size limit is that
// IOError).
void write_idx(const std::string& path, const Tensor& data, bool gzip);

}  // namespace nanoddp::data
