"""A router's view of pdworker's request-level API: Python grpcio (Debian's
python3-grpcio) with stubs that protoc's grpc_python_plugin generated from
proto/vllm_engine.proto, the way SMG or llm-d would call a vLLM worker.

  vllm_engine_client.py --target=127.0.0.1:PORT --scenarios=FILE --out=FILE

Runs the scenarios of the JSON file and writes what the worker answered to
--out as JSON; the C++ test (vllm_engine_api_test.cc) judges the answers
against the model. Asserts only what needs no model: the shape of the
streams, the status codes of refusals.
"""
import argparse
import hashlib
import io
import json
import sys
import threading
import time
import zipfile

import grpc
from proto import smg_common_pb2
from proto import vllm_engine_pb2 as pb
from proto import vllm_engine_pb2_grpc as pb_grpc

TIMEOUT = 120


def sampling_params(spec):
    """SamplingParams as SMG sends them: every field set, neutral or not."""
    p = pb.SamplingParams(
        top_p=spec.get("top_p", 0.0),
        top_k=spec.get("top_k", 0),
        min_p=spec.get("min_p", 0.0),
        frequency_penalty=spec.get("frequency_penalty", 0.0),
        presence_penalty=spec.get("presence_penalty", 0.0),
        repetition_penalty=spec.get("repetition_penalty", 1.0),
        min_tokens=spec.get("min_tokens", 0),
        stop=spec.get("stop", []),
        stop_token_ids=spec.get("stop_token_ids", []),
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        ignore_eos=spec.get("ignore_eos", True),
        n=spec.get("n", 1),
        include_stop_str_in_output=False,
    )
    if "temperature" in spec:
        p.temperature = float(spec["temperature"])  # "nan" too
    if "max_tokens" in spec:
        p.max_tokens = spec["max_tokens"]
    if "logprobs" in spec:
        p.logprobs = spec["logprobs"]
    if "seed" in spec:
        p.seed = spec["seed"]
    for key, value in spec.get("logit_bias", {}).items():
        p.logit_bias[int(key)] = value
    if "prompt_logprobs" in spec:
        p.prompt_logprobs = spec["prompt_logprobs"]
    if "regex" in spec:
        p.regex = spec["regex"]
    if "truncate_prompt_tokens" in spec:
        p.truncate_prompt_tokens = spec["truncate_prompt_tokens"]
    return p


def request(spec):
    r = pb.GenerateRequest(
        request_id=spec["id"],
        sampling_params=sampling_params(spec.get("params", {})),
        stream=spec.get("stream", False),
    )
    if "text" in spec:
        r.text = spec["text"]
    elif "prompt" in spec:
        r.tokenized.original_text = "ignored by the worker"
        r.tokenized.input_ids.extend(spec["prompt"])
    if spec.get("mm_inputs"):
        r.mm_inputs.im_token_id = 5
    if spec.get("data_parallel_rank") is not None:
        r.data_parallel_rank = spec["data_parallel_rank"]
    return r


def logprobs_json(lp):
    return {
        "token_ids": list(lp.token_ids),
        "token_logprobs": list(lp.token_logprobs),
        "top": [{"token_ids": list(t.token_ids), "values": list(t.values)}
                for t in lp.top_logprobs],
    }


def generate(stub, spec):
    """One Generate call: every response, in order, as JSON."""
    out = {"chunks": [], "complete": None, "code": "OK", "message": ""}
    try:
        for response in stub.Generate(request(spec), timeout=TIMEOUT):
            kind = response.WhichOneof("response")
            if kind == "chunk":
                c = response.chunk
                assert out["complete"] is None, "a chunk after complete"
                out["chunks"].append({
                    "token_ids": list(c.token_ids),
                    "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": c.completion_tokens,
                    "logprobs": logprobs_json(c.output_logprobs),
                })
            else:
                c = response.complete
                assert out["complete"] is None, "two completes"
                out["complete"] = {
                    "output_ids": list(c.output_ids),
                    "finish_reason": c.finish_reason,
                    "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": c.completion_tokens,
                    "matched_token_id": (c.matched_token_id
                                         if c.WhichOneof("matched_stop")
                                         else None),
                    "logprobs": logprobs_json(c.output_logprobs),
                }
    except grpc.RpcError as e:
        out["code"] = e.code().name
        out["message"] = e.details()
    if out["code"] == "OK":
        assert out["complete"] is not None, "a stream without complete"
        if not spec.get("stream", False):
            assert not out["chunks"], "chunks without stream"
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.scenarios) as f:
        scenarios = json.load(f)
    results = {}

    with grpc.insecure_channel(args.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = pb_grpc.VllmEngineStub(channel)

        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
        results["model_info"] = {
            "model_path": info.model_path,
            "is_generation": info.is_generation,
            "max_context_length": info.max_context_length,
            "vocab_size": info.vocab_size,
            "architectures": list(info.architectures),
            "eos_token_ids": list(info.eos_token_ids),
            "bos_token_id": info.bos_token_id,
            "max_req_input_len": info.max_req_input_len,
            "served_model_name": info.served_model_name,
        }
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT)
        results["health"] = {"healthy": health.healthy,
                             "message": health.message}

        # GetTokenizer: the chunks concatenate to a zip whose SHA-256 the
        # last chunk names.
        data = b""
        sha = ""
        for chunk in stub.GetTokenizer(smg_common_pb2.GetTokenizerRequest(),
                                       timeout=TIMEOUT):
            assert not sha, "data after the chunk with the SHA-256"
            data += chunk.data
            sha = chunk.sha256
        results["tokenizer"] = {
            "sha256_ok": hashlib.sha256(data).hexdigest() == sha,
            "names": zipfile.ZipFile(io.BytesIO(data)).namelist(),
            "tokenizer_json": zipfile.ZipFile(io.BytesIO(data)).read(
                "tokenizer.json").decode(),
        }

        for name, call in (
                ("embed", lambda: stub.Embed(pb.EmbedRequest(request_id="e"),
                                             timeout=TIMEOUT)),
                ("kv_events", lambda: list(stub.SubscribeKvEvents(
                    smg_common_pb2.SubscribeKvEventsRequest(),
                    timeout=TIMEOUT)))):
            try:
                call()
                results[name] = "OK"
            except grpc.RpcError as e:
                results[name] = e.code().name

        # Every generation scenario, one after another.
        results["generate"] = [generate(stub, s)
                               for s in scenarios["generate"]]

        # Many at once, streaming: each ends whole.
        concurrent = scenarios["concurrent"]
        outs = [None] * len(concurrent)

        def run(i):
            outs[i] = generate(stub, concurrent[i])

        threads = [threading.Thread(target=run, args=(i,))
                   for i in range(len(concurrent))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results["concurrent"] = outs

        # Abort mid-stream through the Abort RPC: the stream ends with a
        # complete whose finish_reason is "abort".
        spec = scenarios["abort"]
        stream = stub.Generate(request(spec), timeout=TIMEOUT)
        got = []
        for response in stream:
            if response.WhichOneof("response") == "chunk":
                got.extend(response.chunk.token_ids)
                if len(got) >= 2:
                    break
        stub.Abort(pb.AbortRequest(request_ids=[spec["id"]]), timeout=TIMEOUT)
        final = None
        for response in stream:
            if response.WhichOneof("response") == "chunk":
                got.extend(response.chunk.token_ids)
            else:
                final = response.complete
        results["abort"] = {
            "tokens": got,
            "finish_reason": final.finish_reason if final else None,
        }
        try:
            stub.Abort(pb.AbortRequest(request_ids=["never-was"]),
                       timeout=TIMEOUT)
            results["abort_unknown"] = "OK"
        except grpc.RpcError as e:
            results["abort_unknown"] = e.code().name

        # A client that disconnects mid-stream (cancels the call).
        spec = scenarios["disconnect"]
        stream = stub.Generate(request(spec), timeout=TIMEOUT)
        seen = 0
        for response in stream:
            seen += len(response.chunk.token_ids)
            if seen >= 2:
                break
        stream.cancel()
        results["disconnect"] = {"tokens_before_cancel": seen}

        # Give the worker a moment to see the cancellation, then its load.
        for _ in range(200):
            loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT)
            if loads.loads[0].num_total_reqs == 0:
                break
            time.sleep(0.05)
        load = loads.loads[0]
        results["loads"] = {
            "dp_rank_count": loads.dp_rank_count,
            "num_running_reqs": load.num_running_reqs,
            "num_waiting_reqs": load.num_waiting_reqs,
            "num_total_reqs": load.num_total_reqs,
            "num_used_tokens": load.num_used_tokens,
            "max_total_num_tokens": load.max_total_num_tokens,
            "token_usage": load.token_usage,
            "timestamp": loads.timestamp,
        }
        server = stub.GetServerInfo(pb.GetServerInfoRequest(),
                                    timeout=TIMEOUT)
        results["server_info"] = {
            "active_requests": server.active_requests,
            "uptime_seconds": server.uptime_seconds,
            "server_type": server.server_type,
            "last_receive_timestamp": server.last_receive_timestamp,
        }

    with open(args.out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
