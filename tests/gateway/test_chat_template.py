"""A model without a chat template (a base model): completions served, chat refused with a
400 that says how to give one; a given template (--chat-template) reaches the gateway."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.controller.service_limits import describe_model
from tests.gateway.conftest import http_post, local_controller_config, start_server

TURNS = "{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def base_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with no chat template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("base_model")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config.pop("chat_template")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def base_server(loop_thread: Any, base_model_dir: Path) -> Iterator[Any]:
    from bucketserve.controller.controller import Controller

    tenants = [TenantConfig(name="default")]
    config = local_controller_config(base_model_dir, tenants, topology="colocated")
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start(), timeout=300)
    server = start_server(loop_thread, controller)
    yield server
    loop_thread.run(server.stop(0))
    loop_thread.run(controller.shutdown())


def test_a_base_model_serves_completions_and_refuses_chat_naming_the_fix(
    base_server: Any,
) -> None:
    url = base_server.http_url
    status, body, _ = http_post(f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    status, body, _ = http_post(
        f"{url}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}
    )
    assert status == 400
    message = body["error"]["message"]
    assert "no chat template" in message and "--chat-template FILE" in message
    assert "model.chat_template" in message and "/v1/completions" in message


def test_a_given_template_is_the_served_tokenizers(base_model_dir: Path) -> None:
    """What model.chat_template / --chat-template set (ModelRunnerConfig.chat_template) is
    what the gateway renders chat with."""
    config = local_controller_config(base_model_dir, [TenantConfig(name="default")])
    info, _ = describe_model(config)
    with pytest.raises(ValueError, match="no chat template"):
        info.tokenizer.apply_chat_template(MESSAGES)
    runner = config.runner.model_copy(update={"chat_template": TURNS})
    config = config.model_copy(update={"runner": runner})
    info, _ = describe_model(config)
    assert info.tokenizer.apply_chat_template(MESSAGES) == "<user> Hi\n"
