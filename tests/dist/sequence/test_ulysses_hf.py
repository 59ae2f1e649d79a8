"""ALST with a Hugging Face Llama, the way DeepSpeed's tutorial trains one: the attention
registered with ``UlyssesSPAttentionHF.register_with_transformers`` (sp 2), its mpu given to
``initialize``, each rank's DataLoader wrapped in ``UlyssesSPDataLoaderAdapter`` and the loss
``causal_lm_loss`` of the pieces' ``shift_labels``. Per-step losses and final weights equal
single-process training of the same model on the whole sequences, in the order the adapter
feeds them (each rank's batch in turn), with 1 and 2 replicas, ZeRO 0-3, grouped-query and
multi-query attention, and a length the group does not divide."""

import pytest
import torch
from torch.utils.data import DataLoader

import shardwise
from shardwise.testing import run_distributed

SP, BATCH, STEPS = 2, 2, 4


def _llama(kv_heads):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _samples(rank, seq):
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(BATCH * STEPS):
        ids = torch.randint(0, 64, (seq,), generator=gen)
        labels = ids.clone()
        labels[: int(torch.randint(0, 4, (), generator=gen))] = -100  # uneven counts of targets
        out.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq)})
    return out


def _reference(world, seq, kv_heads, lr):
    """Losses ``[step][replica]`` and final weights of single-process training."""
    model = _llama(kv_heads)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = [_samples(r, seq) for r in range(world)]
    losses = []
    for step in range(STEPS):
        per = []
        for replica in range(world // SP):
            source = data[replica * SP + step % SP][(step // SP) * BATCH : (step // SP + 1) * BATCH]
            batch = {k: torch.stack([s[k] for s in source]) for k in source[0]}
            per.append(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
        torch.stack(per).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([float(p) for p in per])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world_size, seq, kv_heads, stage, keep=False):
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from shardwise.sequence import _kept_attention
    from shardwise.sequence.loss import causal_lm_loss

    lr = 0.5
    ref_losses, ref_weights = _reference(world_size, seq, kv_heads, lr)
    model = _llama(kv_heads)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, BATCH, keep_attention_outputs=keep)
    kernel_runs, flash = [], _kept_attention._FLASH
    if keep:  # checkpointed layers whose recompute takes the forward's attention output
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        _kept_attention._FLASH = lambda *args, **kwargs: kernel_runs.append(1) or flash(*args, **kwargs)
    try:
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
        }
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        engine, _, _, _ = shardwise.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
        group = mpu.get_sequence_parallel_group()
        loader = DataLoader(_samples(rank, seq), batch_size=BATCH)
        adapter = UlyssesSPDataLoaderAdapter(
            loader, mpu.get_sequence_parallel_rank(), group, mpu.get_sequence_parallel_world_size(), "cpu"
        )
        assert len(adapter) == STEPS * SP
        replica = engine.grid.data_parallel_id // SP
        losses, pieces = [], set()
        for _ in range(STEPS):
            batch = next(adapter)
            pieces.add(batch["input_ids"].shape[1])
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = causal_lm_loss(logits, batch["shift_labels"], group=group)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        if stage == 3:
            from shardwise.zero import GatheredParameters

            with GatheredParameters(list(engine.module.parameters())):
                state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        else:
            state = engine.module.state_dict()
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()
        _kept_attention._FLASH = flash
    loss_error = max(abs(a - ref[replica]) for a, ref in zip(losses, ref_losses))
    weight_error = max(float((state[k] - ref_weights[k]).abs().max()) for k in ref_weights)
    return loss_error, weight_error, pieces, len(kernel_runs)


@pytest.mark.parametrize(
    ("world", "seq", "kv_heads", "stage", "keep"),
    [(2, 16, 2, 0, False), (2, 15, 1, 2, False), (4, 16, 2, 2, False), (4, 16, 2, 3, False), (2, 16, 2, 2, True)],
    ids=["gqa-zero0", "mqa-uneven-length-zero2", "dp2-zero2", "dp2-zero3", "checkpointed-kept-attention-zero2"],
)
def test_hf_llama_with_ulysses_equals_whole_sequence_training(tmp_path, world, seq, kv_heads, stage, keep):
    """With ``keep_attention_outputs`` and activation checkpointing, the attention kernel also runs
    once per layer and step: the recompute takes the forward's output."""
    results = run_distributed(
        _train, world_size=world, tmp_path=tmp_path, seq=seq, kv_heads=kv_heads, stage=stage, keep=keep
    )
    for rank, (loss_error, weight_error, pieces, kernel_runs) in enumerate(results):
        assert loss_error < 1e-5, (rank, loss_error)
        assert weight_error < 1e-5, (rank, weight_error)
        assert pieces == {seq // SP + (rank % SP < seq % SP)}  # only this rank's piece of each sequence
        assert kernel_runs == (STEPS * 2 if keep else 0), kernel_runs  # 2 layers


def _refused(rank, world_size):
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    messages = []
    for implementation in ("eager", "flex_attention", "no_such_attention"):
        try:
            UlyssesSPAttentionHF.register_with_transformers(_llama(2), implementation, SP, BATCH)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_attention_implementations_that_cannot_be_split_are_refused(tmp_path):
    for messages in run_distributed(_refused, world_size=2, tmp_path=tmp_path):
        assert len(messages) == 3, messages
        assert "full [seq, seq] mask" in messages[0] and "not available" in messages[1]


def _collectives_per_forward(rank, world_size):
    from shardwise.comm import Communicator
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    counts = {"all_to_all_single": 0, "all_gather_into_tensor": 0}
    originals = {name: getattr(Communicator, name) for name in counts}

    def counting(name):
        def call(self, *args, **kwargs):
            counts[name] += 1
            return originals[name](self, *args, **kwargs)

        return call

    model = _llama(2)
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, BATCH)
    try:
        for name in counts:
            setattr(Communicator, name, counting(name))
        ids = torch.randint(0, 64, (BATCH, 8))
        positions = torch.arange(rank * 8, rank * 8 + 8).expand(BATCH, 8)
        model(input_ids=ids, position_ids=positions)
    finally:
        for name, original in originals.items():
            setattr(Communicator, name, original)
        UlyssesSPAttentionHF.unregister_from_transformers()
    return counts


def test_lengths_and_positions_are_exchanged_once_per_forward(tmp_path):
    """Per layer: the query, key, value and output all-to-alls; per forward: one all-gather of
    the piece lengths and one all-to-all of the position ids (the same tensor in every layer)."""
    for counts in run_distributed(_collectives_per_forward, world_size=2, tmp_path=tmp_path):
        assert counts == {"all_to_all_single": 2 * 4 + 1, "all_gather_into_tensor": 1}, counts


def _gathered_batches(rank, world_size):
    import torch.distributed as dist

    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    pickled = []
    original = dist.all_gather_object

    def counting(*args, **kwargs):
        pickled.append(1)
        return original(*args, **kwargs)

    seq = 6 + 3 * rank  # the ranks' sequences differ in length
    gen = torch.Generator().manual_seed(rank)
    tensors = {
        "input_ids": torch.randint(0, 64, (1, seq), generator=gen),
        "position_ids": torch.arange(seq)[None],
        "labels": torch.randint(0, 64, (1, seq), generator=gen),
        "weights": torch.randn(1, seq, generator=gen).to(torch.bfloat16),
        "keep": torch.rand(1, seq, 2, generator=gen) > 0.5,
        "doc": torch.tensor(rank),
    }
    with_text = {**tensors, "text": f"rank {rank}"}
    dist.all_gather_object = counting
    try:
        got = []
        for batch in (tensors, with_text):
            adapter = UlyssesSPDataLoaderAdapter([batch], rank, None, world_size, "cpu")
            got.append([next(adapter) for _ in range(world_size)])
    finally:
        dist.all_gather_object = original
    return tensors, with_text, got, len(pickled)


def test_the_adapter_moves_tensor_batches_without_pickling(tmp_path):
    """Tensor batches (lengths differing by rank, int, bf16, bool and 0-dim values) reach every
    rank in rank order as tensor all-gathers; a batch holding anything else is pickled."""
    results = run_distributed(_gathered_batches, world_size=2, tmp_path=tmp_path)
    for rank, (_, _, got, pickled) in enumerate(results):
        assert pickled == 1, pickled  # only the batch with a string
        for kind, pieces in enumerate(got):
            assert len(pieces) == 2
            for source, piece in enumerate(pieces):
                sent = results[source][kind]
                seq = sent["input_ids"].shape[1]
                first = seq - seq // 2  # the first piece holds the odd position
                mine = slice(*(((0, first), (first, seq))[rank]))
                shifted = torch.nn.functional.pad(sent["labels"], (0, 1), value=-100)[:, 1:]
                assert piece.keys() == {*sent.keys(), "shift_labels"} - {"labels"}
                assert torch.equal(piece["shift_labels"], shifted[:, mine])
                for key in ("input_ids", "position_ids", "weights", "keep"):
                    assert piece[key].dtype == sent[key].dtype and torch.equal(piece[key], sent[key][:, mine]), key
                assert torch.equal(piece["doc"], sent["doc"]) and piece["doc"].dim() == 0
                assert kind == 0 or piece["text"] == sent["text"]
