// The Fashion-MNIST training job (examples/fashion_mnist.cpp), as its two programs start it:
// fashion_mnist trains the MLP, fashion_mnist_cnn the CNN (examples/fashion_mnist_main.cpp).
#pragma once

namespace nanoddp::examples {

// Parses argv, trains, prints the JSON line; returns the exit status: 0, 1 for a run that
// failed, 2 for a usage error (argparse's convention, tools/cli_checks.h).
int fashion_mnist_main(int argc, char** argv, bool cnn);

}  // namespace nanoddp::examples
