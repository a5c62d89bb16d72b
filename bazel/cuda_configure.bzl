"""Repository rule that finds the CUDA toolkit without downloading anything.

Looks at $CUDA_HOME, then /usr/local/cuda. When a usable toolkit (nvcc and
cuda_runtime.h) is found, the generated repository exposes its headers and
libraries; otherwise every target is an empty library and CUDA_AVAILABLE is
False, so the whole workspace still builds CPU-only. Targets that depend on
@local_cuda//:cudart get PDW_HAVE_CUDA=1 or PDW_HAVE_CUDA=0 accordingly.

Force a CPU-only build on a machine that has CUDA with CUDA_HOME=/nonexistent.
"""

def _find_lib(rctx, root, names):
    for d in ["lib64", "lib", "targets/x86_64-linux/lib"]:
        for n in names:
            if rctx.path(root + "/" + d + "/" + n).exists:
                return root + "/" + d
    for d in ["/usr/lib/x86_64-linux-gnu", "/usr/lib64"]:
        for n in names:
            if rctx.path(d + "/" + n).exists:
                return d
    return None

_EMPTY_LIB = """
cc_library(
    name = "{name}",
    defines = ["PDW_HAVE_CUDA=0"],
    visibility = ["//visibility:public"],
)
"""

_LIB = """
cc_library(
    name = "{name}",
    linkopts = ["-L{libdir}", "-Wl,-rpath,{libdir}"] + {libs},
    defines = ["PDW_HAVE_CUDA=1"],
    deps = [":cuda_headers"],
    visibility = ["//visibility:public"],
)
"""

# NCCL: its own define, so a CUDA toolkit without NCCL still builds the CUDA
# backend (PDW_HAVE_CUDA=1) and only the NCCL transport goes away.
_NCCL_LIB = """
cc_library(
    name = "nccl",
    linkopts = ["-L{libdir}", "-Wl,-rpath,{libdir}", "-lnccl"],
    defines = ["PDW_HAVE_NCCL=1"],
    deps = [":cudart"],
    visibility = ["//visibility:public"],
)
"""

_NO_NCCL = """
cc_library(
    name = "nccl",
    defines = ["PDW_HAVE_NCCL=0"],
    visibility = ["//visibility:public"],
)
"""

def _cuda_configure_impl(rctx):
    cuda_home = rctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    root = rctx.path(cuda_home)
    nvcc = rctx.path(cuda_home + "/bin/nvcc")
    header = rctx.path(cuda_home + "/include/cuda_runtime.h")
    available = root.exists and nvcc.exists and header.exists

    build = ['package(default_visibility = ["//visibility:public"])\n']
    if not available:
        build.append(_EMPTY_LIB.format(name = "cuda_headers"))
        for name in ["cudart", "cublas"]:
            build.append(_EMPTY_LIB.format(name = name))
        build.append(_NO_NCCL)
        rctx.file("defs.bzl", "\n".join([
            "CUDA_AVAILABLE = False",
            "NCCL_AVAILABLE = False",
            'CUDA_PATH = ""',
            'NVCC = ""',
            "",
        ]))
        rctx.file("BUILD.bazel", "\n".join(build))
        return

    # Resolve symlinks (/usr/local/cuda -> cuda-13.0) so rpaths are stable.
    real = str(root.realpath)
    rctx.symlink(real + "/include", "include")
    build.append("""
cc_library(
    name = "cuda_headers",
    # CUDA headers include extension-less files (e.g. cuda/std/...), so glob all.
    hdrs = glob(["include/**"]),
    includes = ["include"],
)
""")
    cudart_dir = _find_lib(rctx, real, ["libcudart.so"])
    cublas_dir = _find_lib(rctx, real, ["libcublas.so"])
    nccl_dir = _find_lib(rctx, real, ["libnccl.so"])
    build.append(_LIB.format(name = "cudart", libdir = cudart_dir, libs = '["-lcudart"]'))
    build.append(_LIB.format(name = "cublas", libdir = cublas_dir, libs = '["-lcublas", "-lcublasLt"]'))
    if nccl_dir:
        build.append(_NCCL_LIB.format(libdir = nccl_dir))
    else:
        build.append(_NO_NCCL)
    rctx.file("defs.bzl", "\n".join([
        "CUDA_AVAILABLE = True",
        "NCCL_AVAILABLE = %s" % ("True" if nccl_dir else "False"),
        'CUDA_PATH = "%s"' % real,
        'NVCC = "%s/bin/nvcc"' % real,
        "",
    ]))
    rctx.file("BUILD.bazel", "\n".join(build))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_HOME"],
    local = True,
)
