"""`kiln serve` on the tiny Gemma 3 vision-language engine: an image sent through the official openai client as a
data URL content part, answered as the offline engine answers the same message (whose prompt and greedy tokens
tests/engine/test_vision_gemma3.py holds to transformers), with a step budget that makes the scheduler defer the
image's run to a step of its own."""

from __future__ import annotations

import pytest
from gemma3_vision_fixtures import TOKENS_PER_IMAGE
from test_vision_server import data_url, image_message
from vision_fixtures import sample_images

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from server_process import Server  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_gemma3_vlm_engine, tmp_path_factory):
    srv = Server(tiny_gemma3_vlm_engine, tmp_path_factory.mktemp("serve-gemma3") / "server.log", "--num-threads", "1",
                 "--served-model-name", "gemma3", "--max-num-batched-tokens", "20")
    yield srv
    assert srv.stop() == 0


def test_gemma3_takes_an_image_url_and_answers_as_the_offline_engine(server, tiny_gemma3_vlm_engine):
    from kiln.runtime import LLM, RuntimeConfig, SamplingParams

    messages = image_message(data_url(sample_images()["rgb-portrait"]), "What is in this picture?")
    done = server.client().chat.completions.create(model="gemma3", messages=messages, max_tokens=6, temperature=0,
                                                   extra_body={"ignore_eos": True})
    offline = LLM(tiny_gemma3_vlm_engine, RuntimeConfig(kv_cache_bytes=4 << 20)).chat(
        messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert done.usage.prompt_tokens == len(offline.prompt_token_ids) > TOKENS_PER_IMAGE + 10
    assert done.choices[0].message.content == offline.outputs[0].text
    assert server.metric("kiln_images_encoded_total") == 1
