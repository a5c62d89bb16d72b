"""pdw_fuzz_target: one libFuzzer target in two builds.

  <name>_corpus_test  a cc_test that runs LLVMFuzzerTestOneInput over every
                      file of the target's seed corpus (tests/fuzz/corpus/
                      <name>/): a regression test in every configuration
                      (gcc, clang, the sanitizers), no libFuzzer needed.
  <name>              the fuzzer (libFuzzer's main), tagged manual: it links
                      only with --config=fuzz (clang), e.g.
                        bazel build --config=fuzz //tests/fuzz:<name>
                      scripts/fuzz runs them.
"""

def pdw_fuzz_target(name, srcs, deps, size = "small", testonly = True):
    corpus = "corpus/" + name
    native.filegroup(
        name = name + "_corpus",
        srcs = native.glob([corpus + "/*"]),
        testonly = testonly,
    )
    native.cc_test(
        name = name + "_corpus_test",
        size = size,
        srcs = srcs,
        deps = deps + ["//tests/fuzz:corpus_main"],
        data = [":" + name + "_corpus"],
        args = [native.package_name() + "/" + corpus],
    )
    native.cc_binary(
        name = name,
        srcs = srcs,
        deps = deps,
        testonly = testonly,
        linkopts = ["-fsanitize=fuzzer"],
        tags = ["manual", "fuzz_target"],
    )
