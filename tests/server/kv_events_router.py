"""A cache-aware router's view of pdworker workers, written the way llm-d's
KV-cache indexer works and with nothing of ours: Debian's pyzmq and msgpack
for vLLM's ZMQ KV events, grpcio for SMG's SubscribeKvEvents.

For every worker it subscribes to the PUB socket, rebuilds everything
published before it joined through the replay socket (a late subscriber),
then follows the live stream while the test runs traffic. It keeps the set
of block hashes each worker holds (BlockStored adds, BlockRemoved removes,
AllBlocksCleared empties). When the test says traffic is done (a file
appears) it scores each probe prompt per worker as the indexer does: hash
the prompt's full blocks itself (pdworker's documented chain: SHA-256 over
the parent digest and the block's token ids as little-endian int32, from a
root salted with the model fingerprint; the event hash is the digest's first
8 bytes, big-endian), take the longest prefix whose blocks the worker holds,
capped at (n - 1) // block_size blocks, times block_size. It also reads each
worker's SubscribeKvEvents history and checks it carries the same events.

Writes {"scores": [[tokens per worker] per probe], "batches": [...],
"replayed": [...], "live": [...]} to --out and exits 0, or prints why not
and exits 1.
"""

import argparse
import hashlib
import json
import os
import struct
import sys
import time

import grpc
import msgpack
import zmq
from proto import smg_common_pb2
from proto import vllm_engine_pb2_grpc as pb_grpc

END_SEQ = b"\xff" * 8


def digests(tokens, fingerprint, block_size):
    """The chained SHA-256 digests of the full blocks of `tokens`."""
    parent = hashlib.sha256(b"pdworker-prefix-cache-v1\0" +
                            fingerprint.encode()).digest()
    out = []
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size:(b + 1) * block_size]
        parent = hashlib.sha256(parent +
                                struct.pack(f"<{block_size}i", *block)).digest()
        out.append(parent)
    return out


def external(digest):
    return int.from_bytes(digest[:8], "big")


def fields(event):
    """(type, block_hashes) of a map- or array-layout event."""
    if isinstance(event, dict):
        return event["type"], event.get("block_hashes", [])
    return event[0], (event[1] if len(event) > 1 else [])


class Worker:
    def __init__(self, ctx, spec):
        self.spec = spec
        self.topic = spec["topic"].encode()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(spec["endpoint"])
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(spec["replay_endpoint"])
        self.batches = {}  # seq -> events
        self.replayed = 0
        self.live = 0

    def add(self, seq, payload, source):
        if seq in self.batches:
            return
        ts, events, rank = msgpack.unpackb(payload, raw=False,
                                           strict_map_key=False)
        assert isinstance(ts, float) and rank == 0, (ts, rank)
        self.batches[seq] = events
        if source == "replay":
            self.replayed += 1
        else:
            self.live += 1

    def replay(self, start):
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert self.dealer.poll(10000), "replay: no reply"
            frames = self.dealer.recv_multipart()
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                return
            assert topic == self.topic, topic
            self.add(int.from_bytes(seq, "big"), payload, "replay")

    def poll_live(self):
        got = False
        while self.sub.poll(0):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic, topic
            seq = int.from_bytes(seq, "big")
            if self.batches and seq > max(self.batches) + 1:
                self.replay(max(self.batches) + 1)
            self.add(seq, payload, "live")
            got = True
        return got

    def stored(self):
        """The hashes the worker holds after every batch, in order."""
        assert sorted(self.batches) == list(range(len(self.batches))), (
            "sequence numbers are not 0..N-1")
        held = set()
        for seq in sorted(self.batches):
            for event in self.batches[seq]:
                kind, hashes = fields(event)
                if kind == "BlockStored":
                    held.update(hashes)
                elif kind == "BlockRemoved":
                    held.difference_update(hashes)
                else:
                    assert kind == "AllBlocksCleared", kind
                    held.clear()
        return held

    def grpc_events(self, count):
        """The first `count` batches of SubscribeKvEvents, as
        (kind, hashes) lists in the ZMQ form."""
        channel = grpc.insecure_channel(self.spec["grpc_target"])
        stub = pb_grpc.VllmEngineStub(channel)
        stream = stub.SubscribeKvEvents(
            smg_common_pb2.SubscribeKvEventsRequest(start_sequence_number=0),
            timeout=60)
        out = []
        for batch in stream:
            events = []
            for e in batch.events:
                which = e.WhichOneof("data")
                if which == "stored":
                    events.append(("BlockStored", [
                        b.block_hash & (2**64 - 1) for b in e.stored.blocks]))
                elif which == "removed":
                    events.append(("BlockRemoved", [
                        h & (2**64 - 1) for h in e.removed.block_hashes]))
                else:
                    events.append(("AllBlocksCleared", []))
            out.append(events)
            if len(out) == count:
                stream.cancel()
                break
        channel.close()
        return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--done", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.config) as f:
        config = json.load(f)
    ctx = zmq.Context()
    workers = [Worker(ctx, spec) for spec in config["workers"]]
    # Joined late: rebuild what was published before, through the replay
    # socket (after the SUB socket connected, so nothing falls between).
    time.sleep(0.3)
    for w in workers:
        w.replay(0)
    print("ready", flush=True)

    # Live while the test runs traffic; then until quiet for a second.
    deadline = time.monotonic() + 120
    quiet_since = None
    while True:
        assert time.monotonic() < deadline, "timed out"
        got = any([w.poll_live() for w in workers])
        if os.path.exists(args.done):
            if got or quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > 1.0:
                break
        time.sleep(0.005)

    fingerprint = config["fingerprint"]
    bs = config["block_size"]
    held = [w.stored() for w in workers]
    scores = []
    for probe in config["probes"]:
        hashes = [external(d) for d in digests(probe, fingerprint, bs)]
        cap = (len(probe) - 1) // bs
        row = []
        for h in held:
            n = 0
            while n < min(cap, len(hashes)) and hashes[n] in h:
                n += 1
            row.append(n * bs)
        scores.append(row)

    # SMG's stream carries the same events, batch for batch.
    for i, w in enumerate(workers):
        zmq_form = [[fields(e) for e in w.batches[s]] for s in sorted(w.batches)]
        grpc_form = w.grpc_events(len(zmq_form))
        assert grpc_form == [[(k, list(h)) for k, h in b] for b in zmq_form], (
            f"worker {i}: SubscribeKvEvents differs from the ZMQ events")

    with open(args.out, "w") as f:
        json.dump({"scores": scores,
                   "batches": [len(w.batches) for w in workers],
                   "replayed": [w.replayed for w in workers],
                   "live": [w.live for w in workers],
                   "held": [len(h) for h in held]}, f)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"kv_events_router: {e}", flush=True)
        sys.exit(1)
