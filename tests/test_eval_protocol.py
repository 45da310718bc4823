"""Protocol details settled against the reference (issue 13 item 7): a sample's own system
prompt travels through regeneration into the drafters' training text; the template's default is
inserted only where the template has one."""

from __future__ import annotations

import json

from configs.micro import config as micro_config
from dspark_jax.config.pipeline import DataStage
from dspark_jax.run.pipeline import Pipeline
from dspark_jax.templates import RenderConfig


def test_sample_system_prompt_is_kept_and_no_default_for_the_demo_template(tmp_path):
    rows = [
        {"conversations": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": "bonjour"},
        ]},
        {"conversations": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"},
        ]},
    ]  # fmt: skip
    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = micro_config()
    cfg = cfg.__class__(
        **{**cfg.__dict__, "run_dir": str(tmp_path / "run"),
           "data": DataStage(conversation_files=(str(f),))}
    )  # fmt: skip
    p = Pipeline(cfg, log=lambda *a: None)
    got = sorted(p._regen_requests(p._regen_order()).values(), key=lambda r: r[1])
    assert got == [("Answer in French.", ["hello"]), (None, ["hi"])]
    convs = p._training_conversations()
    assert [m.role for m in convs[0].messages][0] == "system"
    assert p.render_config() == RenderConfig()  # the demo's ChatML template: no default
