// What the native kernels need of torch: tensors, dtype dispatch, at::parallel_for, at::empty and
// pybind11 with its tensor casters. torch/extension.h would bring the whole C++ frontend
// (autograd, nn, optim) as well, whose parsing was most of each kernel's build: 57 s of
// `g++ -fsyntax-only` against 16 s for these headers, on a 2-core AMD EPYC (family 23).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>
