// What the native kernels need of torch: tensors, dtype dispatch, at::parallel_for, at::empty and
// pybind11 with its tensor casters. torch/extension.h would bring the whole C++ frontend
// (autograd, nn, optim) as well, parsed for nothing: with it the cpu_ops build took 113 s,
// with these headers 95 s, on a 2-core AMD EPYC (family 23). Most of what is left is code
// generation for the kernels themselves (g++ -ftime-report: 78 of 98 s).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/csrc/utils/pybind.h>
