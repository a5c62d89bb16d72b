#!/usr/bin/env python3
"""A KV-event consumer that is not ours: Debian's pyzmq and msgpack, reading
pdworker's ZMQ events the way llm-d's indexer reads vLLM's.

It subscribes (connecting to a bound PUB, or binding a SUB the publisher
connects to), asks the replay ROUTER for everything from 0 on connect (as
llm-d does), replays every gap in the sequence numbers, and checks every
batch, field by field, against the plan the test wrote before publishing:
the three frames, the topic, consecutive sequence numbers, the msgpack
batch [ts, events, data_parallel_rank], and each event in the plan's layout
(vLLM's tagged maps or positional arrays) with its hashes, parent hash,
token ids, block size and vLLM's fixed fields.

Exits 0 when every planned batch arrived and matched; prints one JSON line
{"live": N, "replayed": M} (batches first seen live or through replay).
"""

import argparse
import json
import os
import sys
import time

import msgpack
import zmq

END_SEQ = b"\xff" * 8


class Mismatch(Exception):
    pass


def expect(cond, message):
    if not cond:
        raise Mismatch(message)


def check_event(where, got, want, layout, medium):
    kind = want["type"]
    if layout == "map":
        expect(isinstance(got, dict), f"{where}: not a map: {got!r}")
        if kind == "BlockStored":
            keys = {"type", "block_hashes", "parent_block_hash", "token_ids",
                    "block_size", "lora_id", "medium", "lora_name",
                    "group_idx", "kv_cache_spec_kind"}
        elif kind == "BlockRemoved":
            keys = {"type", "block_hashes", "medium", "group_idx"}
        else:
            keys = {"type"}
        expect(set(got) == keys, f"{where}: keys {sorted(got)} != {sorted(keys)}")
        fields = got
    else:
        expect(isinstance(got, list), f"{where}: not an array: {got!r}")
        names = {
            "BlockStored": ["type", "block_hashes", "parent_block_hash",
                            "token_ids", "block_size", "lora_id", "medium",
                            "lora_name"],
            "BlockRemoved": ["type", "block_hashes", "medium"],
            "AllBlocksCleared": ["type"],
        }[kind]
        expect(len(got) == len(names),
               f"{where}: {len(got)} positions, want {len(names)}: {got!r}")
        fields = dict(zip(names, got))
    expect(fields["type"] == kind, f"{where}: type {fields['type']!r} != {kind!r}")
    if kind in ("BlockStored", "BlockRemoved"):
        hashes = fields["block_hashes"]
        expect(all(type(h) is int for h in hashes), f"{where}: hash types")
        expect(hashes == want["block_hashes"],
               f"{where}: block_hashes {hashes} != {want['block_hashes']}")
        expect(fields["medium"] == medium, f"{where}: medium {fields['medium']!r}")
    if kind == "BlockStored":
        expect(fields["parent_block_hash"] == want["parent_block_hash"],
               f"{where}: parent {fields['parent_block_hash']} != "
               f"{want['parent_block_hash']}")
        expect(fields["token_ids"] == want["token_ids"], f"{where}: token_ids")
        expect(fields["block_size"] == want["block_size"], f"{where}: block_size")
        expect(len(fields["token_ids"]) == len(hashes) * fields["block_size"],
               f"{where}: tokens do not fill the blocks")
        expect(fields["lora_id"] is None and fields["lora_name"] is None,
               f"{where}: lora fields")
        if layout == "map":
            expect(fields["group_idx"] == 0, f"{where}: group_idx")
            expect(fields["kv_cache_spec_kind"] == "full_attention",
                   f"{where}: kv_cache_spec_kind")
    if kind == "BlockRemoved" and layout == "map":
        expect(fields["group_idx"] == 0, f"{where}: group_idx")


def check_batch(seq, payload, plan):
    batches = plan["batches"]
    expect(0 <= seq < len(batches), f"sequence {seq} was never published")
    want = batches[seq]
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    where = f"batch {seq}"
    expect(isinstance(batch, list) and len(batch) == 3,
           f"{where}: not [ts, events, data_parallel_rank]: {batch!r}")
    ts, events, rank = batch
    expect(type(ts) is float and ts == want["ts"], f"{where}: ts {ts!r} != {want['ts']!r}")
    expect(type(rank) is int and rank == plan["dp_rank"], f"{where}: rank {rank!r}")
    expect(isinstance(events, list) and len(events) == len(want["events"]),
           f"{where}: {len(events)} events, want {len(want['events'])}")
    for i, (got, w) in enumerate(zip(events, want["events"])):
        check_event(f"{where} event {i}", got, w, plan["layout"], plan["medium"])


def wait_for_plan(path, deadline):
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise Mismatch(f"no plan at {path}")
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--bind_sub", action="store_true",
                        help="bind the SUB socket (the publisher connects)")
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if args.bind_sub:
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        print(f"sub_endpoint tcp://127.0.0.1:{port}", flush=True)
    plan = wait_for_plan(args.plan, deadline)
    topic = plan["topic"].encode()
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    if not args.bind_sub:
        sub.connect(plan["sub_endpoint"])
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(plan["replay_endpoint"])

    total = len(plan["batches"])
    seen = {}  # seq -> "live" | "replay"

    def handle(seq, payload, source):
        if seq in seen:
            return
        check_batch(seq, payload, plan)
        seen[seq] = source

    def replay(start):
        # vLLM's protocol from a DEALER: ["", start]; replies
        # ["", topic, seq, payload]..., then ["", "", END_SEQ, ""].
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        expected = start
        while True:
            expect(dealer.poll(5000), f"replay from {start}: no reply")
            frames = dealer.recv_multipart()
            expect(len(frames) == 4 and frames[0] == b"",
                   f"replay reply of {len(frames)} frames: {frames[:3]!r}")
            got_topic, seq_bytes, payload = frames[1:]
            if seq_bytes == END_SEQ:
                expect(got_topic == b"" and payload == b"",
                       "replay end marker with a topic or payload")
                return
            expect(got_topic == topic, f"replay topic {got_topic!r}")
            seq = int.from_bytes(seq_bytes, "big")
            expect(seq == expected, f"replay from {start}: {seq} after {expected - 1}")
            expected += 1
            handle(seq, payload, "replay")

    replay(0)  # as llm-d does on connect: rebuild from what is buffered
    print("ready", flush=True)
    newest = max(seen) if seen else -1
    last_replay = time.monotonic()
    while len(seen) < total:
        expect(time.monotonic() < deadline,
               f"timed out with {len(seen)} of {total} batches")
        if sub.poll(100):
            frames = sub.recv_multipart()
            expect(len(frames) == 3, f"live message of {len(frames)} frames")
            got_topic, seq_bytes, payload = frames
            expect(got_topic == topic, f"live topic {got_topic!r}")
            expect(len(seq_bytes) == 8, "sequence frame is not 8 bytes")
            seq = int.from_bytes(seq_bytes, "big")
            if seq > newest + 1:
                replay(newest + 1)  # a gap: ask for what was missed
            handle(seq, payload, "live")
            newest = max(newest, seq)
        elif time.monotonic() - last_replay > 1.0:
            # Quiet: batches published before our subscription reached the
            # publisher are only in its replay buffer.
            missing = min(s for s in range(total) if s not in seen)
            replay(missing)
            newest = max(seen)
            last_replay = time.monotonic()

    expect(sorted(seen) == list(range(total)), "sequence numbers are not 0..N-1")
    print(json.dumps({
        "live": sum(1 for s in seen.values() if s == "live"),
        "replayed": sum(1 for s in seen.values() if s == "replay"),
    }), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Mismatch as e:
        print(f"MISMATCH: {e}", flush=True)
        sys.exit(1)
