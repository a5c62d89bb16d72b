"""cuda_library: compiles .cu files with nvcc (sm_80 + sm_90a) into a cc_library.

Without a CUDA toolkit (see cuda_configure.bzl) the macro produces a header-only
library carrying PDW_HAVE_CUDA=0, so callers guard their CUDA paths with
`#if PDW_HAVE_CUDA` and the workspace still builds CPU-only.
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "NVCC")

# sm_80 (A100) and sm_90a (H100/H200; 'a' enables wgmma/TMA features).
# --config=ci (--define=pdw_cuda_archs=sm_90a) compiles sm_90a alone: CI
# proves the CUDA code compiles, and nvcc's time halves (the sm_80 path
# differs only by `__CUDA_ARCH__ >= 900` guards around PDL); the GPU bundle
# and every other build keep both.
_GENCODE = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
]
_GENCODE_SM90A = [
    "-gencode=arch=compute_90a,code=sm_90a",
]

_NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-Wall",
    "-Werror=all-warnings",
]

def cuda_library(
        name,
        srcs,
        hdrs = [],
        textual_hdrs = [],
        deps = [],
        nvcc_flags = [],
        **kwargs):
    """Compiles each .cu in srcs with nvcc and wraps the objects in a cc_library.

    Args:
      name: target name.
      srcs: .cu files (one op family per file pair).
      hdrs: headers declaring the launchers (plain C++, includable by .cc files).
      textual_hdrs: device-code headers (.cuh) that only the .cu files include;
        they are nvcc inputs and are not exported to C++ dependents.
      deps: cc_library deps whose headers the .cu files include.
      nvcc_flags: extra nvcc flags.
      **kwargs: forwarded to the cc_library (visibility, tags, ...).
    """
    if not CUDA_AVAILABLE:
        native.cc_library(
            name = name,
            hdrs = hdrs,
            deps = deps + ["@local_cuda//:cudart"],
            **kwargs
        )
        return

    objs = []
    for src in srcs:
        stem = src.replace("/", "_").rsplit(".", 1)[0]

        # .pic.o so Bazel links the object into both shared and static outputs.
        obj = "_nvcc_%s/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + hdrs + textual_hdrs + [
                "@local_cuda//:pdw_cuda_config.h",
                "@local_cuda//:cuda_headers",
            ],
            outs = [obj],
            # -I. and the bin dir so '#include "worker/kernels/x.h"' resolves.
            cmd = " ".join([
                NVCC,
                "-c $(location %s)" % src,
                "-o $@",
                "-I.",
                "-I$(GENDIR)",
                "-Iexternal/local_cuda/include",
                # pdw_cuda_config.h (PDW_HAVE_CUDA, PDW_HAVE_NCCL).
                "-Iexternal/local_cuda",
            ] + _NVCC_FLAGS + nvcc_flags) + " " + select({
                "//bazel:cuda_sm90a_only": " ".join(_GENCODE_SM90A),
                "//conditions:default": " ".join(_GENCODE),
            }),
            tags = ["cuda"],
        )
        objs.append(obj)

    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        # The objects only hold kernels and launchers reached through hdrs.
        alwayslink = True,
        **kwargs
    )
