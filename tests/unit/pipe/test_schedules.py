"""Pipeline schedules as data: structure of every action list, and the simulator's idle time.

The properties are computed here from the action lists directly (not with the helpers
under test), so a schedule and a checker cannot share a bug.
"""

from collections import Counter

import pytest

from shardwise.pipe.schedules import (
    SCHEDULES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ScheduleDeadlock,
    SendActivation,
    SendGrad,
    build_schedule,
    chunks_of_stage,
    eval_schedule,
    format_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    simulate,
)

STAGES = (1, 2, 3, 4)
MICRO_BATCHES = (1, 2, 4, 8)


def _cases():
    for name in ("1f1b", "1f1b_split", "gpipe", "zero_bubble"):
        for p in STAGES:
            for m in MICRO_BATCHES:
                yield pytest.param(name, p, m, {}, id=f"{name}-p{p}-m{m}")
    for p in STAGES:
        for m in MICRO_BATCHES:
            if m % p == 0:
                yield pytest.param("interleaved", p, m, {"virtual_stages": 2}, id=f"interleaved-p{p}-m{m}-v2")


CASES = list(_cases())


def _plans(name, p, m, opts):
    return [build_schedule(name, p, m, s, **opts) for s in range(p)]


def _virtual(opts):
    return opts.get("virtual_stages", 1)


@pytest.mark.parametrize("name, p, m, opts", CASES)
def test_each_micro_batch_runs_forward_then_backward_once_per_chunk(name, p, m, opts):
    for s, plan in enumerate(_plans(name, p, m, opts)):
        at = {a: i for i, a in enumerate(plan)}
        counts = Counter(plan)
        assert all(n == 1 for n in counts.values()), f"stage {s} repeats {counts.most_common(1)}"
        for chunk in chunks_of_stage(p, s, virtual_stages=_virtual(opts)):
            for mb in range(m):
                f = Forward(mb, chunk)
                whole, bi, bw = Backward(mb, chunk), BackwardInput(mb, chunk), BackwardWeight(mb, chunk)
                assert f in at, f"stage {s} never runs {f}"
                if whole in at:
                    assert bi not in at and bw not in at, f"stage {s} runs {whole} and a split backward"
                    assert at[f] < at[whole], f"stage {s}: {whole} before {f}"
                else:
                    assert bi in at and bw in at, f"stage {s} never runs the backward of {f}"
                    assert at[f] < at[bi] < at[bw], f"stage {s}: {f}, {bi}, {bw} out of order"
        compute = [a for a in plan if isinstance(a, (Forward, Backward, BackwardInput, BackwardWeight))]
        backwards = [a for a in compute if not isinstance(a, Forward)]
        split = {"zero_bubble": m, "1f1b_split": min(m, p - s)}.get(name, 0)  # backwards run as two halves
        expected = m * _virtual(opts) + split
        assert len(backwards) == expected, f"stage {s}: {len(backwards)} backward actions, expected {expected}"


@pytest.mark.parametrize("name, p, m, opts", CASES)
def test_sends_match_receives(name, p, m, opts):
    plans = _plans(name, p, m, opts)
    num_chunks = p * _virtual(opts)
    sent, received = Counter(), Counter()
    for s, plan in enumerate(plans):
        at = {a: i for i, a in enumerate(plan)}
        for a in plan:
            if isinstance(a, SendActivation):
                assert a.to_stage == (a.chunk + 1) % p and at[Forward(a.micro_batch, a.chunk)] < at[a], a
                sent[("act", a.micro_batch, a.chunk, s, a.to_stage)] += 1
            elif isinstance(a, RecvActivation):
                assert a.from_stage == (a.chunk - 1) % p and at[a] < at[Forward(a.micro_batch, a.chunk)], a
                received[("act", a.micro_batch, a.chunk - 1, a.from_stage, s)] += 1
            elif isinstance(a, SendGrad):
                produced = next(
                    b
                    for b in plan
                    if isinstance(b, (Backward, BackwardInput)) and (b.micro_batch, b.chunk) == (a.micro_batch, a.chunk)
                )
                assert a.to_stage == (a.chunk - 1) % p and at[produced] < at[a], a
                sent[("grad", a.micro_batch, a.chunk, s, a.to_stage)] += 1
            elif isinstance(a, RecvGrad):
                consumer = next(
                    b
                    for b in plan
                    if isinstance(b, (Backward, BackwardInput)) and (b.micro_batch, b.chunk) == (a.micro_batch, a.chunk)
                )
                assert a.from_stage == (a.chunk + 1) % p and at[a] < at[consumer], a
                received[("grad", a.micro_batch, a.chunk + 1, a.from_stage, s)] += 1
    assert sent == received, f"unmatched: sent only {sent - received}, received only {received - sent}"
    transfers = 0 if p == 1 else m * (num_chunks - 1)
    assert sum(1 for k in sent if k[0] == "act") == transfers
    assert sum(1 for k in sent if k[0] == "grad") == transfers


@pytest.mark.parametrize("name, p, m, opts", CASES)
def test_simulator_runs_every_action_without_deadlock(name, p, m, opts):
    result = simulate(name, p, m, **opts)
    plans = _plans(name, p, m, opts)
    assert [len(row) for row in result.timeline] == [len(plan) for plan in plans]
    assert [a for _, _, a in result.timeline[0]] == plans[0]
    work = m * _virtual(opts) * 3.0  # forward 1 + backward input 1 + weight 1
    assert result.busy == pytest.approx([work] * p)
    assert 0.0 <= result.idle_fraction < 1.0


@pytest.mark.parametrize("name, p, m, opts", CASES)
def test_reduce_grads_per_chunk_after_its_weight_gradients_then_one_step(name, p, m, opts):
    for s, plan in enumerate(_plans(name, p, m, opts)):
        assert plan[-1] == OptimizerStep() and plan.count(OptimizerStep()) == 1, f"stage {s}"
        for chunk in chunks_of_stage(p, s, virtual_stages=_virtual(opts)):
            reduces = [i for i, a in enumerate(plan) if a == ReduceGrads(chunk)]
            assert len(reduces) == 1, f"stage {s} reduces chunk {chunk} {len(reduces)} times"
            last_grad = max(
                i for i, a in enumerate(plan) if isinstance(a, (Backward, BackwardWeight)) and a.chunk == chunk
            )
            assert last_grad < reduces[0], f"stage {s} reduces chunk {chunk} before its last weight gradient"
        assert sum(isinstance(a, ReduceGrads) for a in plan) == _virtual(opts)


def test_1f1b_compute_order_is_deepspeeds():
    # DeepSpeed's TrainSchedule runs stage s's forward of micro-batch i at step 2i + s and
    # its backward at step 2i + 2p - s - 1 (checked against deepspeed 0.19.8's schedule).
    for p in STAGES:
        for m in MICRO_BATCHES:
            for s in range(p):
                steps = [(2 * i + s, Forward(i, s)) for i in range(m)]
                steps += [(2 * i + 2 * p - s - 1, Backward(i, s)) for i in range(m)]
                expected = [a for _, a in sorted(steps, key=lambda x: x[0])]
                got = [a for a in one_f_one_b(p, m, s) if isinstance(a, (Forward, Backward))]
                assert got == expected, f"p={p} m={m} stage {s}"


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_1f1b_idle_fraction_is_the_closed_form(p, m):
    closed = (p - 1) / (m + p - 1)
    assert abs(simulate("1f1b", p, m, t_forward=1.0, t_backward=2.0).idle_fraction - closed) < 1e-9
    assert abs(simulate("gpipe", p, m).idle_fraction - closed) < 1e-9  # same bubble, more memory


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 9)])
def test_interleaved_idle_is_about_one_vth_of_1f1b(p, m):
    one = simulate("1f1b", p, m).idle_fraction
    for v in (2, 3):
        idle = simulate("interleaved", p, m, virtual_stages=v).idle_fraction
        assert idle < one
        # bubble (p-1)/v forward+backward times against m of them
        assert abs(idle - (p - 1) / (v * m + p - 1)) < 1e-9, f"v={v}"


@pytest.mark.parametrize("p", STAGES[1:])
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_zero_bubble_idles_less_than_1f1b(p, m):
    zb = simulate("zero_bubble", p, m).idle_fraction
    if m >= p:
        assert zb < simulate("1f1b", p, m).idle_fraction
        # ZB-H1 with equal F, B, W: a third of 1F1B's bubble
        assert abs(zb - (p - 1) / (3 * m + p - 1)) < 1e-9
    else:
        assert zb <= simulate("1f1b", p, m).idle_fraction + 1e-12


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_1f1b_split_saves_a_weight_half_per_stage_of_the_drain(p, m):
    """With forward = input half = weight half = 1: 1F1B's makespan is 3 (m + p - 1);
    splitting the drain's backwards sends each stage's last input gradient a weight half
    sooner, p - 1 in all: 3m + 2 (p - 1), idle (2p - 2) / (3m + 2p - 2)."""
    split = simulate("1f1b_split", p, m)
    assert split.makespan == 3 * m + 2 * (p - 1)
    assert abs(split.idle_fraction - (2 * p - 2) / (3 * m + 2 * p - 2)) < 1e-9
    assert simulate("1f1b", p, m).makespan - split.makespan == p - 1


def _held(plan):
    held = peak = 0
    for a in plan:
        if isinstance(a, Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(a, (Backward, BackwardWeight)):
            held -= 1
    return peak


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_activation_memory_per_stage(p, m):
    for s in range(p):
        plan = one_f_one_b(p, m, s)
        assert _held(plan) == peak_in_flight(plan) == min(m, p - s), f"1f1b stage {s}"
        assert _held(build_schedule("zero_bubble", p, m, s)) <= min(m, p), f"zero_bubble stage {s}"
        assert _held(build_schedule("1f1b_split", p, m, s)) == min(m, p - s), f"1f1b_split stage {s}"
        assert _held(build_schedule("gpipe", p, m, s)) == m


def test_communication_time_adds_idle_time():
    free = simulate("1f1b", 4, 8)
    slow = simulate("1f1b", 4, 8, t_comm=0.5)
    assert slow.makespan > free.makespan and slow.idle_fraction > free.idle_fraction
    assert simulate("1f1b", 1, 8, t_comm=5.0).idle_fraction == 0.0


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", (1, 3, 8))
@pytest.mark.parametrize("v", (1, 2))
def test_eval_schedule_runs_forwards_only(p, m, v):
    plans = [eval_schedule(p, m, s, virtual_stages=v) for s in range(p)]
    for s, plan in enumerate(plans):
        forwards = [a for a in plan if isinstance(a, Forward)]
        assert sorted((a.micro_batch, a.chunk) for a in forwards) == sorted(
            (mb, c) for mb in range(m) for c in chunks_of_stage(p, s, virtual_stages=v)
        )
        assert all(isinstance(a, (Forward, SendActivation, RecvActivation)) for a in plan)
    result = simulate(eval_schedule, p, m, virtual_stages=v)
    assert result.busy == pytest.approx([m * v * 1.0] * p)


def test_schedule_table_and_timeline_print():
    assert format_schedule([one_f_one_b(2, 3, s) for s in range(2)]) == (
        "stage 0: F0 F1 B0 F2 B1 B2 R S\nstage 1: F0 B0 F1 B1 F2 B2 R S"
    )
    assert format_schedule(one_f_one_b(2, 1, 1), comm=True) == "stage 0: ra0 F0 B0 sg0 R S"
    assert str(Forward(3, 0)) == "F(mb=3, chunk=0)"
    assert "c2" in format_schedule([build_schedule("interleaved", 2, 2, s, virtual_stages=2) for s in range(2)])
    text = str(simulate("1f1b", 2, 2))
    assert text.splitlines()[0] == "stage 0 | F0 F1 .. .. B0--- .. B1---"
    assert "idle fraction 0.333" in text


def test_bad_names_and_options_are_refused():
    with pytest.raises(ValueError, match=r"allowed: 1f1b, 1f1b_split, gpipe, interleaved, zero_bubble \(or 'eval'"):
        build_schedule("1F1B", 2, 4, 0)
    assert build_schedule("eval", 2, 4, 1) == eval_schedule(2, 4, 1)
    assert sorted(SCHEDULES) == ["1f1b", "1f1b_split", "gpipe", "interleaved", "zero_bubble"]
    with pytest.raises(ValueError, match="'1f1b' takes no option virtual_stages"):
        build_schedule("1f1b", 2, 4, 0, virtual_stages=2)
    with pytest.raises(ValueError, match="multiple of num_stages"):
        build_schedule("interleaved", 4, 6, 0, virtual_stages=2)
    with pytest.raises(ValueError, match="stage_id must be in"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ValueError, match="num_micro_batches must be >= 1"):
        one_f_one_b(2, 0, 0)
    with pytest.raises(ValueError, match="virtual_stages must be >= 1"):
        build_schedule("interleaved", 2, 4, 0, virtual_stages=0)


def test_simulator_reports_a_deadlock_with_the_stuck_actions():
    # Stage 0 without 1F1B's warm-up waits for micro-batch 0's gradient before it sends
    # micro-batch 1; stage 1 (GPipe order) needs micro-batch 1 before it sends that gradient.
    def broken(p, m, s):
        if s == 1:
            return gpipe(p, m, s)
        return [
            Forward(0, 0),
            SendActivation(0, 0, 1),
            RecvGrad(0, 0, 1),
            Backward(0, 0),
            Forward(1, 0),
            SendActivation(1, 0, 1),
            RecvGrad(1, 0, 1),
            Backward(1, 0),
            ReduceGrads(0),
            OptimizerStep(),
        ]

    with pytest.raises(ScheduleDeadlock) as err:
        simulate(broken, 2, 2)
    text = str(err.value)
    assert "stage 0: RecvGrad(mb=0, chunk=0, from=1) waits for SendGrad(mb=0, chunk=1, to=0) on stage 1" in text
    assert "stage 1: RecvAct(mb=1, chunk=1, from=0) waits for SendAct(mb=1, chunk=0, to=1) on stage 0" in text


def test_simulator_refuses_unmatched_messages_and_misplaced_reductions():
    def no_send(p, m, s):
        return [a for a in one_f_one_b(p, m, s) if a != SendActivation(1, 0, 1)]

    with pytest.raises(ValueError, match="sends and receives do not match"):
        simulate(no_send, 2, 2)

    def early_reduce(p, m, s):
        plan = [a for a in one_f_one_b(p, m, s) if not isinstance(a, ReduceGrads)]
        return [ReduceGrads(s)] + plan

    with pytest.raises(ValueError, match=r"runs B\(mb=0, chunk=0\) after ReduceGrads\(chunk=0\)"):
        simulate(early_reduce, 2, 2)


@pytest.mark.parametrize("m", [1, 4, 8])
def test_per_stage_durations_give_the_slow_stages_bound(m):
    """Two unequal stages under 1F1B: when the last stage is the slower one (forward +
    backward), the step is the first stage's first forward, the last stage's m forwards
    and backwards back to back, and the first stage's last backward."""
    f, b = (3.0, 4.0), (5.0, 7.0)
    result = simulate("1f1b", 2, m, t_forward=f, t_backward=b)
    assert result.makespan == f[0] + m * (f[1] + b[1]) + b[0]
    assert result.busy == (m * (f[0] + b[0]), m * (f[1] + b[1]))
    # one number for all stages is the same as that number per stage
    assert (
        simulate("zero_bubble", 2, m, t_forward=2.0).makespan
        == simulate("zero_bubble", 2, m, t_forward=(2.0, 2.0)).makespan
    )
    with pytest.raises(ValueError, match="one value per stage"):
        simulate("1f1b", 2, m, t_forward=(1.0, 2.0, 3.0))
