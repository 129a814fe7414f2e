// main() of fashion_mnist and of fashion_mnist_cnn. The job is compiled once
// (examples/fashion_mnist.cpp); this file, compiled once per program, only says which model
// the program trains.
#include "examples/fashion_mnist.h"

#ifndef NANODDP_FASHION_MNIST_CNN
#define NANODDP_FASHION_MNIST_CNN 0
#endif

int main(int argc, char** argv) {
  return nanoddp::examples::fashion_mnist_main(argc, argv, NANODDP_FASHION_MNIST_CNN != 0);
}
