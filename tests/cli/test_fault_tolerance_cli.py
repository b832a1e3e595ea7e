"""``--fault-tolerance torchft`` from the CLI: three replica groups of ``diloco`` meet at ``gradsync lighthouse``;
one is SIGKILLed mid-period, the other two go on averaging over two, the killed one is restarted, heals from a
live group and, after its first round, all three hold the same model and algorithm state bit for bit.
Without a failure, three groups train exactly as a three-process ``diloco`` run."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cli_process
from gradsync.strategies.parts import parts_dir, read_parts

pytest.importorskip("torchft", reason="the ft extra (pip install gradsync[ft]) is not installed")

pytestmark = pytest.mark.timeout(300)

TESTS = Path(__file__).resolve().parents[1]
DILOCO = ["--strategy", "diloco", "--strategy.period", "4", "--accelerator", "cpu", "--devices", "1"]
SYNC = ["--strategy", "sync", "--accelerator", "cpu", "--devices", "1"]
DILOCO_INT8 = [*DILOCO[:4], "--strategy.codec", "int8", *DILOCO[4:]]
# fragments: a round of one of two halves of the model every 2 steps
DILOCO_INT8_FRAGMENTS = [*DILOCO_INT8[:6], "--strategy.fragments", "2", *DILOCO_INT8[6:]]
COMPRESSED_INT8 = ["--strategy", "compressed", "--strategy.codec", "int8", "--strategy.error_feedback", "true",
                   *SYNC[2:]]
TIMEOUT = ["--timeout", "60"]  # a group left waiting for a quorum fails within a minute


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo",
            "GRADSYNC_FT_HOSTNAME": "127.0.0.1", "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **extra}


def _cmd(*args):
    return [sys.executable, "-m", "gradsync.cli.main", *args]


def _lighthouse(tmp_path, min_replicas):
    """``gradsync lighthouse`` on a free port, for the test: its address."""
    address_file = tmp_path / "lighthouse"
    proc = cli_process.popen(_cmd("lighthouse", "--min-replicas", str(min_replicas), "--port", "0", "--address-file",
                                  str(address_file)), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    deadline = time.monotonic() + 60
    while not address_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "no address"
        time.sleep(0.1)
    port = address_file.read_text().strip().rsplit(":", 1)[1]
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def lighthouse(tmp_path):
    """A lighthouse whose first quorum waits for all three groups: they start together at step 0."""
    yield from _lighthouse(tmp_path, 3)


@pytest.fixture
def lighthouse_of_two(tmp_path):
    """A lighthouse that forms a quorum of two: the others go on when one of three groups is down."""
    yield from _lighthouse(tmp_path, 2)


DIGITS = ("ft_probe.PacedDigits", "gradsync.recipes.digits.DigitsData")
BATCHNORM = ("ecosystem_modules.BatchNormNet", "ecosystem_modules.RandomData")  # floating buffers


def _group(index, lighthouse, out, *extra, env=None, model=DIGITS, strategy=DILOCO, groups=3):
    return cli_process.popen(
        _cmd("fit", "--model", model[0], "--data", model[1], *strategy,
             "--fault-tolerance", "torchft", "--lighthouse", lighthouse, "--replica-group", str(index),
             "--replica-groups", str(groups), *TIMEOUT, "--output-dir", str(out / f"group{index}"), *extra),
        env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path, procs, timeout=180):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        assert all(p.poll() is None for p in procs), "a group stopped"
        time.sleep(0.05)


def _weights(run_dir):
    """The model of a run's last checkpoint (sharded: its shards, consolidated as ``gradsync export`` does)."""
    from gradsync.cli.export import export

    state = export(str(run_dir))[1]
    assert state, f"{run_dir}: no model in its checkpoint"
    return state


def _optimizer_tensors(run_dir):
    """The optimizer state's tensors in a run's last checkpoint, by a flat key (sharded: consolidated from the
    shards every process wrote)."""
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    sharded = (ckpt.get("gradsync") or {}).get("sharded")
    if not sharded:
        return {f"{i}.{k}": v for i, s in ckpt["optimizer_states"][0]["state"].items() for k, v in s.items()
                if isinstance(v, torch.Tensor)}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = parts_dir(run_dir / "checkpoints" / "last.ckpt") / sharded["shards"]
    if sharded.get("node_dirs"):  # each node's replica in a folder of its own (a group is one node)
        folder = folder / "node0"
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if ".optimizer." in f".{key}" and isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def _same_algorithm_state(parts):
    """Every process's checkpoint part holds the same diloco state: global parameters, outer momentum, counters
    and the fragment schedule (which fragments the last round left equal), bit for bit."""
    for p in parts[1:]:
        for a, b in zip(p["global_params"], parts[0]["global_params"]):
            assert torch.equal(a, b)
        for key, state in p["outer_optimizer"]["state"].items():
            assert torch.equal(state["momentum_buffer"], parts[0]["outer_optimizer"]["state"][key]["momentum_buffer"])
        assert p["num_steps"] == parts[0]["num_steps"] and p["outer_steps"] == parts[0]["outer_steps"]
        assert p["agreed"] == parts[0]["agreed"]


def test_a_killed_group_drops_out_rejoins_heals_and_ends_identical(tmp_path, lighthouse_of_two):
    lighthouse = lighthouse_of_two
    steps, back = 60, tmp_path / "group2-is-back"
    # the survivors train on after group 2 dies, and hold at step 20 until the restarted group has started;
    # the 40 steps after it leave the restarted group ample time to join one of their rounds
    pace = _env(FT_STEP_SECONDS="0.05")
    hold = {**pace, "FT_HOLD_AT": "20", "FT_HOLD_FILE": str(back)}
    run = ("--max-steps", str(steps), "--checkpoint-every", "8")
    # int8 with error feedback crosses between the groups (the benchmark's codec), in two fragments; its
    # per-group residuals are not shared: the restarted group's stale one (from its checkpoint) is dropped at
    # its heal round
    groups = [_group(g, lighthouse, tmp_path, *run, env=hold, strategy=DILOCO_INT8_FRAGMENTS) for g in (0, 1)]
    victim = _group(2, lighthouse, tmp_path, *run, env={**pace, "FT_DIE_AT": "11"},
                    strategy=DILOCO_INT8_FRAGMENTS)
    out, _ = victim.communicate(timeout=200)
    # killed at step 11, between two fragments' rounds (one at every even step, fragments 0 and 1 in turn)
    assert victim.returncode == -9, out[-3000:]
    _wait_for(Path(str(back) + ".waiting"), groups)  # the survivors went on without it, up to step 20
    # restarted as a user would, into its folder and its step-8 checkpoint: it resumes from it, then heals
    restarted = _group(2, lighthouse, tmp_path, *run, "--resume", "auto", env={**pace, "FT_STARTED_FILE": str(back)},
                       strategy=DILOCO_INT8_FRAGMENTS)
    logs = [p.communicate(timeout=240)[0] for p in (*groups, restarted)]
    for p, log in zip((*groups, restarted), logs):
        assert p.returncode == 0, log[-3000:]
    # the progress line says how many groups the last round averaged over, and the goodput so far
    assert "groups 2" in logs[0] and "groups 3" in logs[0] and "goodput " in logs[0], logs[0][-3000:]

    summaries = [json.loads((tmp_path / f"group{g}" / "summary.json").read_text()) for g in range(3)]
    ft = [s["strategy_stats"]["fault_tolerance"] for s in summaries]
    assert all(s["global_step"] == steps for s in summaries)
    # the survivors averaged over the two live groups while group 2 was down, over three again after it
    # healed; they never restarted
    for survivor in ft[:2]:
        per_round = survivor["participants"]["per_round"]
        # the rounds of steps 12 to 20 at least without it, and the restarted group's heal round (where it is
        # not counted)
        assert per_round.count(2) >= 6 and per_round[-1] == 3, per_round
        # (the only heal a survivor may have is at the start, had it joined after the others' first quorum)
        assert survivor["failures_seen"] >= 1 and survivor["heals"] <= 1
        # its goodput counts the round that waited out the dead group's heartbeat (2 s, against steps of
        # milliseconds) as time lost
        assert 0 < survivor["goodput"] < 0.99, survivor
    # the restarted group healed once, from a live peer, taking over its step counters; the heal's bytes
    # are booked apart from training traffic
    healed = ft[2]
    # (it took over at a round of the others, after the step it died at)
    taken = healed["steps_healed_over"]
    assert summaries[2]["resumed_from_step"] == 8
    # (into the round of either fragment: the one the others were in)
    # (its figures carry over its first process's, as its ledger does: that one healed too if it started late)
    assert 1 <= healed["heals"] <= 2 and healed["heal_bytes"] > 0 and taken + 8 >= 20, healed
    # heal figures that add up across the restart: the membership line's bytes are the ledger's
    assert summaries[2]["comm"]["other"]["heal"]["wire_bytes"] == healed["heal_bytes"]
    # after its first round every group holds the same model and the same algorithm state, bit for bit
    weights = [_weights(tmp_path / f"group{g}") for g in range(3)]
    for w in weights[1:]:
        assert all(torch.equal(w[k], weights[0][k]) for k in weights[0])
    parts = [read_parts(tmp_path / f"group{g}" / "checkpoints" / "last.ckpt")[0] for g in range(3)]
    _same_algorithm_state(parts)
    # each group keeps its own error-feedback residuals (what int8 did not send of its own pseudo-gradient)
    residuals = [p["reducer"]["residuals"] for p in parts]
    assert all(residuals) and any(not torch.equal(residuals[2][k], residuals[0][k]) for k in residuals[0])


GRADIENTS = ("ft_probe.GradientDigits", "gradsync.recipes.digits.DigitsData")


@pytest.mark.parametrize("strategy", [SYNC, COMPRESSED_INT8], ids=["sync", "compressed-int8"])
def test_a_killed_group_drops_out_of_the_steps_average_and_heals_into_a_step(tmp_path, lighthouse_of_two, strategy):
    """``sync`` and ``compressed`` form a quorum every step (torchft's FT-DDP): while group 2 is down, each step's
    gradient is the mean of the two live groups' own gradients, checked by hand against what each group
    computed (exactly under sync; within int8's rounding, which error feedback carries, under compressed);
    the restarted group heals inside a step of theirs and ends with the same model."""
    lighthouse, steps, back = lighthouse_of_two, 60, tmp_path / "group2-is-back"
    pace = _env(FT_STEP_SECONDS="0.05")
    grads = [tmp_path / f"grads{g}" for g in (0, 1)]
    survivors = []
    for g in (0, 1):
        grads[g].mkdir()
        env = {**pace, "FT_HOLD_AT": "20", "FT_HOLD_FILE": str(back), "FT_GRADS_DIR": str(grads[g])}
        survivors.append(_group(g, lighthouse, tmp_path, "--max-steps", str(steps), env=env, model=GRADIENTS,
                                strategy=strategy))
    victim = _group(2, lighthouse, tmp_path, "--max-steps", str(steps), env={**pace, "FT_DIE_AT": "10"},
                    model=GRADIENTS, strategy=strategy)
    out, _ = victim.communicate(timeout=200)
    assert victim.returncode == -9, out[-3000:]
    _wait_for(Path(str(back) + ".waiting"), survivors)
    # the survivors go on once the restarted group begins its first step, whose quorum it joins to heal
    restarted = _group(2, lighthouse, tmp_path, "--max-steps", str(steps), env={**pace, "FT_FIRST_STEP_FILE": str(back)},
                       model=GRADIENTS, strategy=strategy)
    logs = [p.communicate(timeout=240)[0] for p in (*survivors, restarted)]
    for p, log in zip((*survivors, restarted), logs):
        assert p.returncode == 0, log[-3000:]

    summaries = [json.loads((tmp_path / f"group{g}" / "summary.json").read_text()) for g in range(3)]
    ft = [s["strategy_stats"]["fault_tolerance"] for s in summaries]
    assert all(s["global_step"] == steps for s in summaries)
    per_step = ft[0]["participants"]["per_round"]
    # one quorum per step this group ran: from its first (a group that joins after the others' first quorum
    # heals over the steps before it)
    first = ft[0]["steps_healed_over"]
    assert len(per_step) == steps - first
    groups_at = {first + i: n for i, n in enumerate(per_step)}
    # group 2 died as its step 10 began: whether step 10's quorum still held it depends on timing; steps 11 to
    # 19 cannot (the survivors hold at step 20 until it is back)
    assert all(groups_at[step] == 2 for step in range(11, 20)) and per_step[-1] == 3, per_step
    # the steps the survivors took without group 2: their gradient was the mean of theirs alone, exactly
    # (each divides by two, an exact operation, before the sum)
    checked = 0
    for step, n in groups_at.items():
        if n != 2 or step < 10:
            continue
        saved = [torch.load(d / f"step{step}.pt", weights_only=True) for d in grads]
        assert all(s["applied"] is not None for s in saved), step
        by_hand = [(a + b) / 2 for a, b in zip(saved[0]["own"], saved[1]["own"])]
        for s in saved:
            if strategy is SYNC:
                assert all(torch.equal(x, y) for x, y in zip(s["applied"], by_hand)), f"step {step}"
            else:  # every group decodes the same int8 messages: the same mean, within four levels of the
                # largest entry (each group's residual, its first hop and the second hop: one level each)
                assert all(torch.equal(x, y) for x, y in zip(s["applied"], saved[0]["applied"])), f"step {step}"
                level = max(float(g.abs().max()) for own in (saved[0]["own"], saved[1]["own"]) for g in own) / 127
                assert all(float((x - y).abs().max()) <= 4 * level for x, y in zip(s["applied"], by_hand)), step
        checked += 1
    assert checked >= 9, per_step
    assert ft[0]["failures_seen"] >= 1
    healed = ft[2]
    assert healed["heals"] == 1 and healed["heal_bytes"] > 0 and healed["steps_healed_over"] >= 20, healed
    assert summaries[2]["comm"]["other"]["heal"]["wire_bytes"] == healed["heal_bytes"]
    weights = [_weights(tmp_path / f"group{g}") for g in range(3)]
    for w in weights[1:]:
        assert all(torch.equal(w[k], weights[0][k]) for k in weights[0])


def _groups_end_as_the_job(tmp_path, groups, job):
    """Run the plain job (``fit`` flags) for 12 steps while ``groups`` (12 steps each) train; every group must
    end with the job's weights, bit for bit. Returns group 0's summary."""
    plain = cli_process.run(_cmd("fit", *job, "--max-steps", "12", "--output-dir", str(tmp_path / "plain")),
                            env=_env(), capture_output=True, text=True, timeout=200)
    assert plain.returncode == 0, plain.stderr[-3000:]
    for p in groups:
        log = p.communicate(timeout=200)[0]
        assert p.returncode == 0, log[-3000:]
    reference = _weights(tmp_path / "plain")
    for g in range(len(groups)):
        w = _weights(tmp_path / f"group{g}")
        assert all(torch.equal(w[k], reference[k]) for k in reference), f"group {g} differs from the job"
    return json.loads((tmp_path / "group0" / "summary.json").read_text())


# (local_sgd runs the same rounds: exact, tested by hand over 12 steps)
# (diloco's identity rounds run with the BatchNorm model, its int8 rounds with fragments)
@pytest.mark.parametrize("strategy, model", [(DILOCO, BATCHNORM), (SYNC, DIGITS), (COMPRESSED_INT8, DIGITS),
                                             (DILOCO_INT8_FRAGMENTS, DIGITS)],
                         ids=["diloco-batchnorm", "sync-digits", "compressed-int8-digits",
                              "diloco-int8-fragments-digits"])
def test_without_a_failure_three_groups_train_exactly_as_one_three_process_job(tmp_path, lighthouse, strategy, model):
    """The groups split the data as the job's ranks do and average over the quorum's process group as the
    job does over its own (the parameters, and BatchNorm's statistics with them): the same model, bit for bit.
    ``sync`` and ``compressed`` form a quorum every step, ``diloco`` every round."""
    groups = [_group(g, lighthouse, tmp_path, "--max-steps", "12", model=model, strategy=strategy) for g in range(3)]
    summary = _groups_end_as_the_job(tmp_path, groups, ["--model", model[0], "--data", model[1], *strategy[:-1], "3"])
    # the join and 3 rounds, or one per step; fragments: the join, a fragment's round every 2 steps and the
    # final round of the fragment that last landed at step 10
    quorums = {id(DILOCO): 4, id(DILOCO_INT8): 4, id(DILOCO_INT8_FRAGMENTS): 8}.get(id(strategy), 12)
    if strategy is DILOCO_INT8_FRAGMENTS:  # int8 messages crossed between the groups: ~4x fewer bytes than the
        assert summary["comm"]["compression_ratio"] > 12, summary["comm"]  # period's 4x (half the model every 2)
    assert summary["strategy_stats"]["fault_tolerance"]["participants"]["per_round"] == [3] * quorums


NODES_OF_TWO = ["--strategy.scope", "node", "--strategy.procs_per_node", "2"]
COMPRESSED_IDENTITY = ["--strategy", "compressed", "--strategy.codec", "identity", *SYNC[2:]]
# FSDP2 inside each group: each process holds half the replica and its optimizer state
DILOCO_INT8_SHARDED = [*DILOCO_INT8[:6], "--strategy.shard", "node", *DILOCO_INT8[6:]]
SYNC_SHARDED = [*SYNC[:2], "--strategy.shard", "node", *SYNC[2:]]


# (diloco's identity rounds take the same ManagedReducer inside the hierarchical mean as sync's steps; compressed's
# steps cross as sync's, through the codec that diloco-int8's rounds cross through)
@pytest.mark.parametrize("strategy, job, quorums", [(DILOCO_INT8, DILOCO_INT8, 4), (SYNC, COMPRESSED_IDENTITY, 12),
                                                    (DILOCO_INT8_SHARDED, DILOCO_INT8_SHARDED, 4),
                                                    (SYNC_SHARDED, SYNC_SHARDED, 12)],
                         ids=["diloco-int8", "sync", "diloco-int8-shard-node", "sync-shard-node"])
def test_two_groups_of_two_processes_train_exactly_as_one_job_of_two_nodes(tmp_path, lighthouse_of_two, strategy,
                                                                            job, quorums):
    """A replica group of several processes is one replica with DDP inside (a node): each process meets its
    local rank's peers in the other group and sends its half of the round or step; the same model, bit for
    bit, as a four-process job whose nodes are two processes each (``sync``'s hierarchical mean is the
    node-scoped ``compressed`` identity codec's)."""
    two = [*strategy[:-1], "2"]
    groups = [_group(g, lighthouse_of_two, tmp_path, "--max-steps", "12", strategy=two, groups=2) for g in range(2)]
    nodes = NODES_OF_TWO[2:] if "--strategy.shard" in job else NODES_OF_TWO  # (shard node implies node scope)
    summary = _groups_end_as_the_job(tmp_path, groups, ["--model", DIGITS[0], "--data", DIGITS[1], *job[:-1], "4",
                                                        *nodes])
    ft = summary["strategy_stats"]["fault_tolerance"]
    assert ft["processes_per_group"] == 2 and ft["participants"]["per_round"] == [2] * quorums
    # DDP inside the group every step; between the groups, each process sends its half of a round's replica or
    # of the step's group mean: the bytes of the job's nodes, hop by hop
    scopes = summary["comm"]["by_scope"]
    plain_scopes = json.loads((tmp_path / "plain" / "summary.json").read_text())["comm"]["by_scope"]
    for hop in ("intra_node", "inter_node"):
        assert scopes[hop]["wire_bytes"] == plain_scopes[hop]["wire_bytes"] > 0, (hop, scopes, plain_scopes)


@pytest.fixture
def lighthouse_of_one(tmp_path):
    """A lighthouse that forms a quorum of one: a group goes on alone while the other is down."""
    yield from _lighthouse(tmp_path, 1)


# (a group of two processes without sharding heals each process as a one-process group heals, the kill tests
# above, and as its sharded self here but for the shards; diloco heals into a round the same state and shards
# that sync heals into a step)
def test_a_sharded_group_of_two_processes_that_torchrun_restarts_heals_shard_by_shard_inside_a_step(
        tmp_path, lighthouse_of_one):
    """One process of a two-process ``sync`` group with FSDP2 inside dies; torchrun (``--max-restarts``)
    restarts the group from its checkpoint; each of its processes takes over the shards of the live group's
    process of its local rank inside a step; both groups end with the same model and optimizer state."""
    lighthouse = lighthouse_of_one
    steps, back = 40, tmp_path / "group1-is-back"
    pace = _env(FT_STEP_SECONDS="0.05")
    run = ("--max-steps", str(steps), "--checkpoint-every", "8", "--max-restarts", "1")
    two = [*SYNC_SHARDED[:-1], "2"]
    survivor = _group(0, lighthouse, tmp_path, *run, strategy=two, groups=2,
                      env={**pace, "FT_HOLD_AT": "20", "FT_HOLD_FILE": str(back)})
    # rank 1 of group 1 dies at step 10; torchrun stops rank 0 and starts both again
    victim = _group(1, lighthouse, tmp_path, *run, strategy=two, groups=2,
                    env={**pace, "FT_DIE_AT": "10", "FT_DIE_RANK": "1", "FT_RESTARTED_FILE": str(back)})
    logs = [p.communicate(timeout=240)[0] for p in (survivor, victim)]
    for p, log in zip((survivor, victim), logs):
        assert p.returncode == 0, log[-3000:]
    summaries = [json.loads((tmp_path / f"group{g}" / "summary.json").read_text()) for g in range(2)]
    ft = [s["strategy_stats"]["fault_tolerance"] for s in summaries]
    assert all(s["global_step"] == steps for s in summaries)
    # the survivor never restarted, and ended averaging over both groups
    assert summaries[0]["restarts"] == 0 and ft[0]["participants"]["last"] == 2, ft[0]
    # the restarted group resumed from its step-8 checkpoint, then healed inside a step of the survivor's, from
    # the one it died at (10) to the one the survivor holds at until it is back (20)
    assert summaries[1]["restarts"] == 1 and summaries[1]["resumed_from_step"] == 8, summaries[1]
    assert ft[1]["heals"] >= 1 and ft[1]["heal_bytes"] > 0, ft[1]
    assert 10 <= 8 + ft[1]["steps_healed_over"] <= 20 and ft[1]["participants"]["last"] == 2, ft[1]
    # from there on, both groups: the same model and the same optimizer state, shard for shard
    weights = [_weights(tmp_path / f"group{g}") for g in range(2)]
    assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0])
    states = [_optimizer_tensors(tmp_path / f"group{g}") for g in range(2)]
    assert states[0] and states[0].keys() == states[1].keys()
    assert all(torch.equal(v, states[1][k]) for k, v in states[0].items()), "the optimizers differ"


def test_a_group_alone_at_the_lighthouse_fails_in_one_line_after_the_timeout(tmp_path, lighthouse):
    r = cli_process.run(_cmd("fit", "--recipe", "digits", *DILOCO, "--max-steps", "8", "--fault-tolerance", "torchft",
                             "--lighthouse", lighthouse, "--replica-group", "0", "--replica-groups", "3", "--timeout", "2",
                             "--output-dir", str(tmp_path / "alone")),
                        env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"gradsync: error: fault tolerance: no quorum at the lighthouse {lighthouse} within 2 s"), line


@pytest.mark.parametrize("devices", ["1", "2"])
def test_an_unreachable_lighthouse_fails_in_one_line(tmp_path, devices):
    """Also from a group of two processes, whose launcher runs torchrun's agent: one line, no traceback."""
    r = cli_process.run(_cmd("fit", "--recipe", "digits", *DILOCO[:-1], devices, "--max-steps", "8",
                             "--fault-tolerance", "torchft",
                             "--lighthouse", "http://127.0.0.1:9", "--replica-group", "0", "--replica-groups", "2",
                             "--timeout", "3", "--output-dir", str(tmp_path / "run")),
                        env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("gradsync: error: fault tolerance: cannot reach the lighthouse http://127.0.0.1:9 ("), line
    assert line.endswith("start it with `gradsync lighthouse --min-replicas N` and pass its address to --lighthouse")
    assert "Traceback" not in r.stderr and r.stderr.count("gradsync: error:") == 1, r.stderr[-3000:]


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at ``port`` (from /proc/net/tcp and tcp6)."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # LISTEN
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host order
                found.add(str(ipaddress.ip_address(raw)))
    return found


def test_the_lighthouse_listens_on_the_address_it_names_not_every_interface(tmp_path):
    import socket

    lighthouse = _lighthouse(tmp_path, 1)
    url = next(lighthouse)
    try:
        port = int(url.rsplit(":", 1)[1])
        assert _listening(port) == {socket.gethostbyname(socket.gethostname())}, _listening(port)
        assert not {"0.0.0.0", "::"} & _listening(port)
    finally:
        next(lighthouse, None)


def test_a_silent_lighthouse_fails_in_one_line_within_the_default_timeout(tmp_path):
    """An address that accepts the connection and never answers (a wrong host behind a firewall looks the same)
    costs the default connect wait (10 s), not torchft's 60 s connect and 300 s quorum waits; the line names
    the whole address and gradsync's --timeout."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    started = time.monotonic()
    r = cli_process.run(_cmd("fit", "--recipe", "digits", *DILOCO, "--max-steps", "8", "--fault-tolerance", "torchft",
                             "--lighthouse", url, "--replica-group", "1", "--replica-groups", "2",
                             "--output-dir", str(tmp_path / "run")), env=_env(), capture_output=True, text=True,
                        timeout=120)
    elapsed = time.monotonic() - started
    silent.close()
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"gradsync: error: fault tolerance: cannot reach the lighthouse {url} ("), line
    assert "waited up to 10 s, --timeout SECONDS waits longer" in line and "connect_timeout" not in line, line
    assert 10 <= elapsed < 40, elapsed  # the wait, plus a process's start-up on a busy machine


def test_a_replica_group_index_in_use_is_refused_in_one_line(tmp_path, lighthouse_of_two):
    """Two jobs started as --replica-group 0: the second is refused while the first is alive (it would train
    on the same share of the data, and nothing would say so); a group restarted after dying is not."""
    first = _group(0, lighthouse_of_two, tmp_path, "--max-steps", "400", groups=2)  # waits for a quorum of two
    try:
        deadline = time.monotonic() + 60
        from gradsync.comm.managed import heartbeat_ages, lighthouse_status

        while "gradsync_0" not in heartbeat_ages(lighthouse_status(lighthouse_of_two, 5)):
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.poll() else ""
            time.sleep(0.2)
        # the same flags (without the check, the two would form a quorum and train together)
        twin = _group(0, lighthouse_of_two, tmp_path / "twin", "--max-steps", "400", groups=2)
        try:
            output = twin.communicate(timeout=60)[0]
        finally:
            twin.kill()
        assert twin.returncode == 2, output[-3000:]
        line = output.strip().splitlines()[-1]
        assert line.startswith(f"gradsync: error: --replica-group 0: a live replica group with this index is already "
                               f"at the lighthouse {lighthouse_of_two} (its latest heartbeat "), line
        assert line.endswith("give each group its own --replica-group 0..1"), line
        assert first.poll() is None  # the first group is untouched
    finally:
        first.kill()
        first.wait(30)
    # the dead group's heartbeat ages: the same index joins again (a restart), past the check
    from gradsync.comm.managed import FaultToleranceConfig, check_lighthouse

    time.sleep(1.0)
    check_lighthouse(FaultToleranceConfig(lighthouse=lighthouse_of_two, replica_group=0, replica_groups=2))


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "async_ps"], "--fault-tolerance torchft runs sync and compressed (a quorum per step), local_sgd "
                                 "and diloco (a quorum per round); --strategy async_ps does not support it yet"),
    (["--strategy", "compressed", "--strategy.codec", "topk"],
     "--fault-tolerance torchft: --strategy.momentum_correction true is not supported across replica groups yet; "
     "use --strategy.momentum_correction false"),
    (["--strategy", "compressed", "--strategy.codec", "sign", "--strategy.momentum_correction", "false"],
     "--fault-tolerance torchft: --strategy.codec sign is not supported across replica groups yet; use "
     "--strategy.codec int8"),
    (["--strategy", "sync", "--strategy.find_unused_parameters", "true"],
     "--fault-tolerance torchft: --strategy.find_unused_parameters true is not supported across replica groups yet; "
     "use --strategy.find_unused_parameters false"),
    (["--strategy", "diloco", "--strategy.codec", "powersgd"],
     "--fault-tolerance torchft: --strategy.codec powersgd is not supported across replica groups yet; use "
     "--strategy.codec int8"),
    (["--strategy", "diloco", "--nnodes", "2"], "--fault-tolerance torchft: a replica group is one node for now; "
                                                "use --nnodes 1 per group and start one job per group"),
    (["--strategy", "compressed", "--strategy.codec", "int8", "--strategy.scope", "node", "--devices", "2"],
     "--fault-tolerance torchft: --strategy.scope node is not supported across replica groups yet; use "
     "--strategy.scope world"),
    (["--strategy", "diloco", "--replica-group", "3"], "--replica-group 3: must be in 0..1 (one less than "
                                                       "--replica-groups)"),
])
def test_what_fault_tolerance_cannot_do_is_one_line_before_launch(capsys, flags, message):
    from gradsync.cli.main import main

    argv = ["fit", "--recipe", "digits", "--accelerator", "cpu", "--fault-tolerance", "torchft", "--lighthouse",
            "http://127.0.0.1:9", "--replica-group", "0", "--replica-groups", "2", *flags]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"gradsync: error: {message}"


def test_the_flags_of_fault_tolerance_need_it_and_fall_back_to_torchfts_environment(capsys, monkeypatch):
    from gradsync.cli.main import main, parse_run

    assert main(["fit", "--recipe", "digits", "--lighthouse", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.strip() == "gradsync: error: --lighthouse needs --fault-tolerance torchft"
    assert main(["fit", "--recipe", "digits", "--strategy", "diloco", "--fault-tolerance", "torchft"]) == 2
    assert "needs --lighthouse http://HOST:PORT (or $TORCHFT_LIGHTHOUSE)" in capsys.readouterr().err
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "4")
    spec = parse_run("fit", ["--recipe", "digits", "--strategy", "diloco", "--fault-tolerance", "torchft"])
    ft = spec.fault_tolerance
    assert (ft.lighthouse, ft.replica_group, ft.replica_groups) == ("http://lh:29510", 1, 4)
    spec = parse_run("fit", ["--recipe", "digits", "--strategy", "diloco", "--fault-tolerance", "torchft",
                             "--replica-group", "3", "--timeout", "30"])
    assert (spec.fault_tolerance.replica_group, spec.fault_tolerance.quorum_timeout) == (3, 30.0)


def test_sync_refuses_a_model_with_floating_buffers_in_one_line(tmp_path):
    r = cli_process.run(_cmd("fit", "--model", BATCHNORM[0], "--data", BATCHNORM[1], *SYNC, "--max-steps", "4",
                             "--fault-tolerance", "torchft", "--lighthouse", "http://127.0.0.1:9", "--replica-group",
                             "0", "--replica-groups", "2", "--output-dir", str(tmp_path / "run")),
                        env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("gradsync: error: --fault-tolerance torchft with sync: the model has floating-point "
                           "buffers ("), line


def test_without_the_extra_one_line_names_it(monkeypatch):
    from gradsync.comm.managed import import_torchft
    from gradsync.errors import GradsyncError

    monkeypatch.setitem(sys.modules, "torchft", None)  # as if it were not installed
    with pytest.raises(GradsyncError, match=r"^--fault-tolerance torchft needs the ft extra: pip install 'gradsync\[ft\]'$"):
        import_torchft()


@pytest.mark.parametrize("devices", [1, 2])
def test_print_launch_gives_the_lighthouse_and_one_job_per_replica_group(capsys, monkeypatch, tmp_path, devices):
    from gradsync.cli.main import main, parse_run

    for var in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"):
        monkeypatch.delenv(var, raising=False)
    out_dir = tmp_path / "my run"
    assert main(["fit", "--recipe", "digits", "--strategy", "diloco", "--devices", str(devices), "--fault-tolerance", "torchft",
                 "--lighthouse", "http://lh.example:29600", "--replica-group", "1", "--replica-groups", "3",
                 "--output-dir", str(out_dir), "--max-steps", "100", "--print-launch"]) == 0
    printed = capsys.readouterr().out
    by_hand, sbatch = printed.split("# SLURM", 1)
    # a round may go on with two of the three groups: the others do not wait for one that died
    assert "\ngradsync lighthouse --min-replicas 2 --port 29600\n" in by_hand
    jobs = [shlex.split(line)[1:] for line in by_hand.splitlines() if line.startswith("gradsync fit")]
    assert len(jobs) == 3
    for g, job in enumerate(jobs):  # each line is the job of group g, as gradsync itself reads it
        spec = parse_run(job[0], job[1:])
        ft = spec.fault_tolerance
        assert (ft.lighthouse, ft.replica_group, ft.replica_groups) == ("http://lh.example:29600", g, 3)
        assert spec.output_dir == out_dir / f"group{g}" and not spec.print_launch
        assert spec.devices == ft.processes == devices
    # one SLURM task per process of a group, each group on a node of its own
    assert f"#SBATCH --ntasks-per-node={devices}\n" in sbatch and f"srun --nodes=1 --ntasks={devices} --exclusive" in sbatch

    # the sbatch script, run by bash with srun, hostname and gradsync standing in as functions that
    # print what they were given: every group starts with its id, the lighthouse's address and its own folder
    script = sbatch.split("\n", 1)[1]
    stand_ins = ('hostname() { echo node0; }\n'
                 'srun() { shift 3; [ "$1" = gradsync ] && shift; '
                 'echo "JOB $TORCHFT_LIGHTHOUSE $REPLICA_GROUP_ID $NUM_REPLICA_GROUPS $(printf \'%q \' "$@")"; }\n'
                 'gradsync() { echo "LIGHTHOUSE $*"; }\n')
    r = subprocess.run(["bash", "-c", stand_ins + script.replace("#!/bin/bash\n", "")], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "LIGHTHOUSE lighthouse --min-replicas 2 --port 29600" in r.stdout
    started = sorted(line.split(" ", 4)[1:] for line in r.stdout.splitlines() if line.startswith("JOB "))
    assert [s[:3] for s in started] == [["http://node0:29600", str(g), "3"] for g in range(3)]
    for g, (lighthouse, group, groups, job) in enumerate(started):
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
        monkeypatch.setenv("REPLICA_GROUP_ID", group)
        monkeypatch.setenv("NUM_REPLICA_GROUPS", groups)
        argv = shlex.split(job)
        spec = parse_run(argv[0], argv[1:])
        assert (spec.fault_tolerance.replica_group, spec.output_dir) == (g, out_dir / f"group{g}")


MISMATCH = "replica groups were started with different configurations: strategy.outer_lr differ"


def test_groups_started_with_different_flags_stop_before_their_first_step_naming_the_field(tmp_path, lighthouse):
    odd = ("--strategy.outer_lr", "0.5")
    groups = [_group(g, lighthouse, tmp_path, "--max-steps", "8", *(odd if g == 2 else ())) for g in range(3)]
    for p in groups:
        log = p.communicate(timeout=200)[0]
        assert p.returncode == 2, log[-3000:]
        assert f"gradsync: error: {MISMATCH} (the groups of this quorum)" in log, log[-3000:]
        assert "step 1/" not in log and "step 4/" not in log


def test_a_group_restarted_with_other_flags_is_refused_at_its_heal_and_the_others_go_on(tmp_path,
                                                                                       lighthouse_of_two):
    lighthouse = lighthouse_of_two
    back = tmp_path / "group2-is-back"
    # the survivors hold at step 8 until the restarted group has started, then have 52 steps (13 rounds)
    # in which it joins one of their rounds, heals and is refused
    hold = _env(FT_STEP_SECONDS="0.05", FT_HOLD_AT="8", FT_HOLD_FILE=str(back))
    groups = [_group(g, lighthouse, tmp_path, "--max-steps", "60", env=hold) for g in (0, 1)]
    victim = _group(2, lighthouse, tmp_path, "--max-steps", "60", env=_env(FT_DIE_AT="6"))
    out, _ = victim.communicate(timeout=200)
    assert victim.returncode == -9, out[-3000:]
    wrong = _group(2, lighthouse, tmp_path, "--max-steps", "60", "--strategy.outer_lr", "0.5",
                   env=_env(FT_STARTED_FILE=str(back)))
    out, _ = wrong.communicate(timeout=200)
    assert wrong.returncode == 2, out[-3000:]
    assert f"gradsync: error: {MISMATCH} (this group and the one it heals from)" in out, out[-3000:]
    for p in groups:
        log = p.communicate(timeout=200)[0]
        assert p.returncode == 0, log[-3000:]
    summaries = [json.loads((tmp_path / f"group{g}" / "summary.json").read_text()) for g in (0, 1)]
    for s in summaries:
        assert s["global_step"] == 60
        assert s["strategy_stats"]["fault_tolerance"]["participants"]["last"] == 2
