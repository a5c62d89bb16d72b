"""P/D through the request-level API the way SMG's sequential P/D relay
drives vLLM workers: the prefill worker gets the request with max_tokens=1
and stream=false, its GenerateComplete carries kv_transfer_params_json, and
the decode worker gets the original request with that JSON. Python grpcio,
stubs generated from proto/vllm_engine.proto.

  vllm_pd_client.py --prefill=HOST:PORT --decode=HOST:PORT
      --aggregated=HOST:PORT --scenarios=FILE --out=FILE

For every scenario: the P/D tokens and the aggregated worker's tokens (the
C++ test compares them), plus the refusals of broken handoffs.
"""
import argparse
import concurrent.futures
import json
import sys

import grpc
from proto import vllm_engine_pb2 as pb
from proto import vllm_engine_pb2_grpc as pb_grpc

TIMEOUT = 120


def request(spec, request_id, max_tokens, stream, kv_json=None):
    p = pb.SamplingParams(top_p=0.0, repetition_penalty=1.0, n=1,
                          ignore_eos=True, max_tokens=max_tokens)
    p.temperature = spec.get("temperature", 0.0)
    if "seed" in spec:
        p.seed = spec["seed"]
    if "top_k" in spec:
        p.top_k = spec["top_k"]
    if "logprobs" in spec:
        p.logprobs = spec["logprobs"]
    r = pb.GenerateRequest(request_id=request_id, sampling_params=p,
                           stream=stream)
    r.tokenized.input_ids.extend(spec["prompt"])
    if kv_json is not None:
        r.kv_transfer_params_json = kv_json
    return r


def collect(stub, req):
    """Tokens, logprobs, the complete message, or the error."""
    tokens, logprobs, complete = [], [], None
    try:
        for response in stub.Generate(req, timeout=TIMEOUT):
            if response.WhichOneof("response") == "chunk":
                tokens.extend(response.chunk.token_ids)
                logprobs.extend(response.chunk.output_logprobs.token_logprobs)
            else:
                complete = response.complete
                if not req.stream:
                    tokens.extend(complete.output_ids)
                    logprobs.extend(complete.output_logprobs.token_logprobs)
    except grpc.RpcError as e:
        return {"code": e.code().name, "message": e.details()}
    return {"code": "OK", "tokens": tokens, "logprobs": logprobs,
            "finish_reason": complete.finish_reason,
            "kv_json": (complete.kv_transfer_params_json
                        if complete.HasField("kv_transfer_params_json")
                        else None)}


def pd(prefill, decode, spec):
    rid = spec["id"]
    # 1. Prefill leg: one token, not streamed.
    first = collect(prefill, request(spec, rid, 1, False))
    if first["code"] != "OK":
        return {"stage": "prefill", **first}
    if first["kv_json"] is None:
        return {"stage": "prefill", "code": "NO_KV_JSON", "message": ""}
    # 2. Decode leg: the original request plus the JSON, streamed.
    second = collect(decode, request(spec, rid, spec["max_tokens"], True,
                                     first["kv_json"]))
    second["stage"] = "decode"
    second["prefill_tokens"] = first["tokens"]
    second["prefill_finish_reason"] = first["finish_reason"]
    second["kv_json"] = first["kv_json"]
    return second


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--prefill", "--decode", "--aggregated", "--scenarios",
                 "--out"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with open(args.scenarios) as f:
        scenarios = json.load(f)
    results = {}
    channels = [grpc.insecure_channel(t)
                for t in (args.prefill, args.decode, args.aggregated)]
    for c in channels:
        grpc.channel_ready_future(c).result(timeout=60)
    prefill, decode, aggregated = [pb_grpc.VllmEngineStub(c) for c in channels]

    specs = scenarios["prompts"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        pd_out = list(pool.map(lambda s: pd(prefill, decode, s), specs))
        agg_out = list(pool.map(
            lambda s: collect(aggregated, request(
                s, s["id"] + "-agg", s["max_tokens"], True)), specs))
    results["pd"] = pd_out
    results["aggregated"] = agg_out

    # Broken handoffs: each refused, and (the C++ test checks) nothing held.
    spec = scenarios["broken"]
    ok = collect(prefill, request(spec, "broken-prefill", 1, False))
    assert ok["code"] == "OK" and ok["kv_json"], ok
    good = json.loads(ok["kv_json"])
    broken = {}
    other_prompt = dict(spec, prompt=spec["prompt"][:-1] + [7])
    broken["other_prompt"] = collect(decode, request(
        other_prompt, "b1", 4, True, ok["kv_json"]))
    broken["not_json"] = collect(decode, request(spec, "b2", 4, True, "{"))
    broken["unknown_key"] = collect(decode, request(
        spec, "b3", 4, True, json.dumps(dict(good, remote_host="x"))))
    lost = dict(good)
    lost["pdworker_kv_handle"] = dict(good["pdworker_kv_handle"],
                                      lease_id="0" * 32)
    broken["unknown_lease"] = collect(decode, request(
        spec, "b4", 4, True, json.dumps(lost)))
    old = dict(good)
    old["pdworker_kv_handle"] = dict(good["pdworker_kv_handle"], version=1)
    broken["old_version"] = collect(decode, request(
        spec, "b5", 4, True, json.dumps(old)))
    broken["handle_to_prefill"] = collect(prefill, request(
        spec, "b6", 1, False, ok["kv_json"]))
    broken["hint_to_prefill"] = collect(prefill, request(
        spec, "b7", 1, False, json.dumps({"do_remote_decode": True})))
    # A number JSON can spell but a double cannot hold (found by
    # tests/fuzz/kv_handle_fuzz: the parser's out_of_range exception ended
    # the worker process), to either role.
    huge = '{"do_remote_decode": true, "first_token": {"logprob": 1e999}}'
    broken["number_overflow_to_decode"] = collect(decode, request(
        spec, "b9", 4, True, huge))
    broken["number_overflow_to_prefill"] = collect(prefill, request(
        spec, "b10", 1, False, huge))
    # The good handle still works after all that (its lease was untouched).
    broken["good"] = collect(decode, request(spec, "b8", 4, True,
                                             ok["kv_json"]))
    results["broken"] = broken

    with open(args.out, "w") as f:
        json.dump(results, f)
    for c in channels:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
