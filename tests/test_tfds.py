"""TFDS through the same record types as JSONL, on a real dataset built here by `tfds` itself
(a tiny GeneratorBasedBuilder prepared into a tmp data_dir as ArrayRecord: no TensorFlow)."""

from __future__ import annotations

import dataclasses

import pytest

from dspark_jax.errors import DataError
from dspark_jax.train.data import Conversation, Prompt, read_conversations, write_conversations
from dspark_jax.train.data_tfds import parse_tfds_spec, read_tfds

tfds = pytest.importorskip("tensorflow_datasets")

CHATS = [
    [("human", "What is 2 + 2?"), ("gpt", "4")],
    [("user", "Name a prime."), ("assistant", "7"), ("user", "Another?"), ("assistant", "11")],
    [("gpt", "starts with the assistant")],  # dropped like in JSONL
    [("user", "   ")],  # empty content: dropped
]


class DsparkTinyChats(tfds.core.GeneratorBasedBuilder):
    """Conversations as a dict of parallel lists (TFDS Sequence of a FeaturesDict) plus a
    single-string prompt feature."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "conversations": tfds.features.Sequence({"from": text, "value": text}),
                    "question": text,
                }
            ),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(CHATS), "test": self._generate_examples(CHATS[:1])}

    def _generate_examples(self, chats):
        for i, chat in enumerate(chats):
            msgs = {"from": [r for r, _ in chat], "value": [c for _, c in chat]}
            yield i, {"conversations": msgs, "question": chat[0][1]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tfds")
    DsparkTinyChats(data_dir=str(d), file_format="array_record").download_and_prepare()
    return str(d)


def test_spec_parsing():
    assert parse_tfds_spec("dspark_tiny_chats") == ("dspark_tiny_chats", "train", None)
    assert parse_tfds_spec("x:train[:90%]") == ("x", "train[:90%]", None)
    assert parse_tfds_spec("x:test:question") == ("x", "test", "question")
    with pytest.raises(ValueError, match="expected name"):
        parse_tfds_spec(":train")


def test_conversations_equal_the_jsonl_reader(data_dir, tmp_path):
    convs, stats = read_tfds(
        "dspark_tiny_chats", kind="conversations", data_dir=data_dir, split="train"
    )
    assert all(isinstance(c, Conversation) for c in convs)
    assert stats.read == 4 and stats.kept == 2 and stats.num_dropped == 2
    # the same rows through JSONL give the same records (order aside: TFDS shuffles on build)
    jsonl = tmp_path / "chats.jsonl"
    rows = [
        {"id": i, "conversations": [{"from": r, "value": c} for r, c in chat]}
        for i, chat in enumerate(CHATS)
    ]
    import json

    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want, jstats = read_conversations(jsonl)
    key = lambda c: c.as_dicts()  # noqa: E731
    assert sorted(map(key, convs), key=str) == sorted(map(key, want), key=str)
    assert stats.dropped == jstats.dropped
    write_conversations(tmp_path / "back.jsonl", convs)  # records round-trip to JSONL
    again, _ = read_conversations(tmp_path / "back.jsonl")
    assert [c.as_dicts() for c in again] == [c.as_dicts() for c in convs]


def test_prompts_auto_and_errors(data_dir):
    prompts, stats = read_tfds(
        "dspark_tiny_chats", split="test", field="question", data_dir=data_dir
    )
    assert [p.turns for p in prompts] == [("What is 2 + 2?",)] and isinstance(prompts[0], Prompt)
    # auto: the conversations feature is found; a prompt field gives user-only conversations
    convs, _ = read_tfds("dspark_tiny_chats", kind="auto", data_dir=data_dir)
    assert len(convs) == 2 and convs[0].messages[-1].role == "assistant"
    users, _ = read_tfds("dspark_tiny_chats", kind="auto", field="question", data_dir=data_dir)
    assert {c.user_turns() for c in users} == {(c[0][1],) for c in CHATS[:3]}  # "   " dropped
    assert all(len(c.messages) == 1 for c in users)
    with pytest.raises(DataError, match=r"tfds:dspark_tiny_chats/train:1: example has no feature"):
        read_tfds("dspark_tiny_chats", data_dir=data_dir)


def test_pipeline_reads_data_tfds(data_dir, tmp_path):
    """`--set data.tfds=name:split` reaches the pipeline's training conversations."""
    from dspark_jax.config.pipeline import DataStage, PipelineConfig, apply_overrides
    from dspark_jax.run.pipeline import Pipeline

    cfg = PipelineConfig(run_dir=str(tmp_path / "run"), data=DataStage(tfds_data_dir=data_dir))
    cfg = apply_overrides(cfg, ["data.tfds=dspark_tiny_chats:train"])
    lines: list[str] = []
    convs = Pipeline(cfg, log=lines.append)._training_conversations()
    assert len(convs) == 2 and all(c.messages[0].role == "user" for c in convs)
    assert any("tfds:dspark_tiny_chats/train" in x and "kept 2" in x for x in lines), lines


def test_regeneration_reads_only_the_rows_it_answers(data_dir, tmp_path):
    """The regenerate stage's requests of chosen rows over a JSONL file and a TFDS split: only
    those rows are parsed, by row index across the sources, invalid rows left out; they equal
    the requests of reading everything."""
    import json

    from dspark_jax.config.pipeline import DataStage, PipelineConfig, apply_overrides
    from dspark_jax.run.pipeline import Pipeline
    from dspark_jax.train.data import count_jsonl_rows, read_conversation_rows

    jsonl = tmp_path / "chats.jsonl"
    rows = [{"conversations": [{"from": r, "value": c} for r, c in chat]} for chat in CHATS]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"broken\n')
    got, stats = read_conversation_rows(jsonl, [3, 1, 0])  # the broken last row: never parsed
    assert [r for r, _ in got] == [0, 1] and stats.read == 3 and stats.kept == 2  # 3: empty
    assert got[0][1].id == 0 and got[1][1].id == 1
    whole, _ = read_tfds("dspark_tiny_chats", kind="auto", data_dir=data_dir)
    some, st = read_tfds("dspark_tiny_chats", kind="auto", data_dir=data_dir, rows=[3, 1])
    assert st.read == 2 and [c.id for c in some] == [c.id for c in whole if c.id in (1, 3)]

    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PipelineConfig(run_dir=str(tmp_path / "run"), data=DataStage(tfds_data_dir=data_dir))
    cfg = apply_overrides(cfg, [f"data.conversation_files={jsonl}",
                                "data.tfds=dspark_tiny_chats:train"])  # fmt: skip
    pipe = Pipeline(cfg, log=lambda _: None)
    n = count_jsonl_rows(jsonl)
    assert pipe._source_rows() == [n, 4]
    every = pipe._regen_requests(range(n + 4))
    assert sorted(pipe._regen_order()) == list(range(n + 4))  # the cap is above these 8 rows
    by_row = {r: (None, list(c.user_turns())) for r, c in read_conversation_rows(jsonl)[0]}
    by_row |= {n + c.id: (None, list(c.user_turns())) for c in whole}
    assert every == by_row  # invalid rows (empty content, a wrong role order) left out
    assert pipe._regen_requests([n + 1, 2]) == {r: every[r] for r in (n + 1, 2) if r in every}


def test_data_tfds_is_part_of_the_stage_keys(data_dir, tmp_path):
    """Another dataset, split or field, or the same dataset rebuilt, re-runs the target and all
    that follows (never a silent reuse); the same settings give the same keys."""
    from dspark_jax.config.pipeline import DataStage, PipelineConfig, apply_overrides
    from dspark_jax.run.pipeline import STAGES, Pipeline

    base = PipelineConfig(run_dir=str(tmp_path / "run"), data=DataStage(tfds_data_dir=data_dir))

    def keys(spec, cfg=base):
        p = Pipeline(apply_overrides(cfg, [f"data.tfds={spec}"]), log=lambda *_: None)
        return {s: p.key(s) for s in STAGES}

    def changed(a, b):
        return {s for s in STAGES if a[s] != b[s]}

    later = {"target", "regenerate", "drafters", "calibrate", "evaluate"}
    train = keys("dspark_tiny_chats:train")
    assert train == keys("dspark_tiny_chats:train")
    assert changed(train, keys("dspark_tiny_chats:test")) == later
    assert changed(train, keys("dspark_tiny_chats:train:question")) == later
    assert changed(train, keys("")) >= later  # the corpus's chats instead
    # another version of the dataset, in another place: a new key
    other = DataStage(tfds_data_dir=str(tmp_path / "tfds2"))
    DsparkTinyChats.VERSION, old = tfds.core.Version("1.0.1"), DsparkTinyChats.VERSION
    try:
        DsparkTinyChats(
            data_dir=other.tfds_data_dir, file_format="array_record"
        ).download_and_prepare()
        newer = keys("dspark_tiny_chats:train", dataclasses.replace(base, data=other))
    finally:
        DsparkTinyChats.VERSION = old
    assert changed(train, newer) == later
