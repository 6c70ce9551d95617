"""Vision-language checkpoints: tiny random LLaVA, Qwen2.5-VL and Gemma 3 stream with a picture exactly as plain
transformers runs them on the same processor inputs, nothing resident and resident; the vision tower is its own unit,
resident whatever the budget and read once per process; `generate --image` and both server APIs take pictures and
refuse every bad one in one line / a 400 in the API's shape."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from cli_contract import one_error_line
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.synthetic.vision import (
    VLM_KINDS,
    processor_needs_torchvision,
    write_vlm,
)
from rocketllm_cli.text.images import MAX_IMAGES
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.sampling import SamplingParams

Image = pytest.importorskip("PIL.Image", reason="the vision tests need Pillow (pip install -e '.[vision]')")

N = 6
QUESTION = "What is in the picture?"
BUDGETS = {
    "nothing resident": {"device_cache_bytes": 0, "host_cache_bytes": 0},
    "resident": {"device_cache_bytes": 1 << 40},
}


def picture(seed: int = 0, size: tuple[int, int] = (40, 36)):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def png_bytes(image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="session")
def vlm(tmp_path_factory):
    """vlm(kind) -> (checkpoint dir, manifest, shard dir), built and sharded once per session."""
    root = tmp_path_factory.mktemp("vlm")
    built: dict = {}

    def build(kind: str):
        if kind not in built:
            source = write_vlm(kind, root / kind)
            manifest, directory, _ = shard(source, out=root / f"{kind}-shards", log=lambda m: None)
            built[kind] = source, manifest, directory
        return built[kind]

    return build


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Files: two pictures, bytes that are no image, a TIFF (decodes, not accepted)."""
    root = tmp_path_factory.mktemp("pictures")
    (root / "a.png").write_bytes(png_bytes(picture(0)))
    (root / "b.jpg").write_bytes(png_bytes(picture(1, (30, 44)), "JPEG"))
    (root / "junk.png").write_bytes(b"this is not an image at all")
    (root / "c.tiff").write_bytes(png_bytes(picture(2), "TIFF"))
    return root


def processor_inputs(kind: str, source, images: list, text: str = QUESTION) -> dict:
    """The inputs transformers' own processor makes of one user message with IMAGES, for plain and streamed alike.

    Qwen2.5-VL's processor needs torchvision in transformers 5; without it its image processor and tokenizer make the
    same
    tensors (the placeholder repeated once per merged patch, as the processor writes it)."""
    content = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    if not processor_needs_torchvision(kind):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(source)
        return dict(
            processor.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
            )
        )
    from transformers import AutoImageProcessor, AutoTokenizer

    pixels = AutoImageProcessor.from_pretrained(source)(images=images, return_tensors="pt")
    tokenizer = AutoTokenizer.from_pretrained(source)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pieces = text.split("<|image_pad|>")
    merged = [int(t.prod()) // 4 for t in pixels["image_grid_thw"]]  # merge_size 2 x 2
    text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(merged, pieces[1:]))
    return {**tokenizer(text, return_tensors="pt"), **pixels}


def plain_greedy(source, inputs: dict) -> list[int]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=N, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# -- streamed equals transformers -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", VLM_KINDS)
def test_streamed_with_a_picture_equals_transformers(vlm, kind):
    source, manifest, directory = vlm(kind)
    assert manifest.vision and all(
        u.module.split(".")[-1] in ("vision_tower", "multi_modal_projector", "visual") for u in manifest.vision
    )
    inputs = processor_inputs(kind, source, [picture(0), picture(1, (30, 44))] if kind != "gemma3" else [picture(0)])
    expected = plain_greedy(source, inputs)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    ids = inputs["input_ids"][0].tolist()
    for name, budgets in BUDGETS.items():
        with StreamingModel(directory, EngineConfig(**budgets), manifest) as model:
            # resident whatever the budget
            assert all(model.plan.tier[u.name] == "device" for u in manifest.vision), name
            # the ledger's per-pass device bytes leave the tower out: it runs once per request, not per token
            assert model.ledger.resident_bytes == sum(
                u.tensor_bytes for u in manifest.units if model.plan.tier[u.name] == "device" and u.kind != "vision"
            )
            generator = Generator(model)
            for _ in range(2):
                outcome = generator.run(GenerationRequest(ids, SamplingParams(max_new_tokens=N), model_inputs=extra))
                assert outcome.token_ids == expected, name
            # the Python API takes the processor's inputs as transformers does
            out = model.generate(**inputs, max_new_tokens=N, do_sample=False)
            assert out[0, len(ids) :].tolist() == expected, name
            assert {u.name: model.ledger.reads[u.name] for u in manifest.vision} == {
                u.name: 1 for u in manifest.vision
            }, name


def test_speculation_is_off_for_a_prompt_with_pictures_and_on_for_text(vlm):
    """Prompt lookup asked for on a streamed model: a prompt with a picture runs without it (its placeholder tokens
    say nothing of the picture) and still equals transformers; a text prompt to the same generator speculates."""
    source, manifest, directory = vlm("llava")
    inputs = processor_inputs("llava", source, [picture(0)])
    expected = plain_greedy(source, inputs)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    ids = inputs["input_ids"][0].tolist()
    with StreamingModel(directory, EngineConfig(**BUDGETS["nothing resident"]), manifest) as model:
        generator = Generator(model, speculate="prompt-lookup")
        assert generator.speculation.on
        with_picture = generator.run(GenerationRequest(ids, SamplingParams(max_new_tokens=N), model_inputs=extra))
        assert with_picture.token_ids == expected
        assert (
            with_picture.stats.speculation["mode"] == "off"
            and "carries images" in with_picture.stats.speculation["reason"]
        )
        text_only = generator.run(
            GenerationRequest(model.tokenizer("hello hello hello")["input_ids"], SamplingParams(max_new_tokens=N))
        )
        assert text_only.stats.speculation["mode"] == "prompt-lookup"


def test_tower_is_counted_in_the_plan_and_budget(vlm):
    from rocketllm_cli.stream.residency import make_plan

    _, manifest, _ = vlm("llava")
    tower = sum(u.tensor_bytes for u in manifest.vision)
    layer = manifest.layers[0].tensor_bytes
    small = {u.name: u.tensor_bytes for u in manifest.units if u.kind in ("embed", "norm", "lm_head")}
    # a budget of the tower, the small units and two layers keeps exactly two layers: the tower's bytes came off first
    plan = make_plan(manifest, tower + sum(small.values()) + 2 * layer, 0)
    assert plan.inputs["k"] == 2 and plan.bytes_per_tier(manifest)["device"] == tower + sum(small.values()) + 2 * layer


# -- generate --image ----------------------------------------------------------------------------------
def invoke(*args):
    return CliRunner().invoke(app, ["generate", *map(str, args)])


def test_generate_image_prints_what_transformers_generates(vlm, pictures):
    source, _, directory = vlm("llava")
    inputs = processor_inputs("llava", source, [Image.open(pictures / "a.png").convert("RGB")])
    expected = plain_greedy(source, inputs)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(source).decode(expected, skip_special_tokens=True)
    result = invoke(directory, QUESTION, "--image", pictures / "a.png", "-n", N)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == text + "\n"
    tower = [line for line in result.stderr.splitlines() if line.startswith("resident modules: vision tower ")]
    assert len(tower) == 1 and "model.vision_tower, model.multi_modal_projector" in tower[0], result.stderr


def test_generate_refuses_bad_pictures_in_one_line(vlm, pictures, tiny_checkpoint):
    _, _, directory = vlm("llava")
    cases = [
        ((directory, "hi", "--image", pictures / "junk.png"), "does not decode as an image"),
        ((directory, "hi", "--image", pictures / "c.tiff"), "TIFF image, which is not supported"),
        ((directory, "hi", "--image", pictures / "missing.png"), "cannot read image file"),
        ((directory, "hi", *["--image", pictures / "a.png"] * (MAX_IMAGES + 1)), f"at most {MAX_IMAGES} are accepted"),
        ((directory, "hi", "--image", pictures / "a.png", "--raw"), "needs the chat template"),
        ((tiny_checkpoint, "hi", "--image", pictures / "a.png"), "takes text only"),
    ]
    for args, words in cases:
        line = one_error_line(invoke(*args, "-n", 2))
        assert words in line, line


@pytest.mark.skipif(
    not processor_needs_torchvision("qwen2_5_vl"), reason="torchvision is installed: Qwen2.5-VL's processor loads"
)
def test_a_processor_that_needs_torchvision_is_named_in_the_refusal(vlm, pictures):
    _, _, directory = vlm("qwen2_5_vl")
    result = invoke(directory, "hi", "--image", pictures / "a.png", "-n", 2)
    assert result.exit_code == 1 and result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()  # the load line says it first, then the one error
    assert lines[0].startswith("resident modules: vision tower") and "images refused" in lines[0], lines
    assert len(lines) == 2 and lines[1].startswith("error: ") and "needs torchvision" in lines[1], lines


# -- serve -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(vlm):
    from serve_helpers import LiveServer

    from rocketllm_cli.auto import AutoModel

    _, _, directory = vlm("gemma3")
    # through AutoModel: its knobs size the server's prefix cache (a model opened by hand keeps none)
    model = AutoModel.from_pretrained(directory, device_cache_bytes=1 << 40)
    with LiveServer(model, "tiny-vlm") as live:
        yield live, model
    model.close()


def test_serve_takes_pictures_through_both_clients(vlm, served):
    source, _, _ = vlm("gemma3")
    live, model = served
    image = picture(3)
    expected = plain_greedy(source, processor_inputs("gemma3", source, [image]))
    text = model.tokenizer.decode(expected, skip_special_tokens=True)
    assert live.openai().models.list().data[0].model_extra["multimodal"] is True
    url = data_url(png_bytes(image))
    for stream in (False, True):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
        reply = live.openai().chat.completions.create(
            model="tiny-vlm",
            messages=[{"role": "user", "content": content}],
            max_tokens=N,
            temperature=0,
            stream=stream,
        )
        got = (
            "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            if stream
            else reply.choices[0].message.content
        )
        assert got == text
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}},
        {"type": "text", "text": QUESTION},
    ]
    message = live.anthropic().messages.create(
        model="tiny-vlm", max_tokens=N, extra_body={"temperature": 0}, messages=[{"role": "user", "content": blocks}]
    )
    assert message.content[0].text == text
    assert live.history[-1]["prompt_tokens"] == message.usage.input_tokens


def test_prefix_cache_is_off_for_pictures_and_on_for_text(served):
    live, _ = served
    if live.state.prefix_cache is None:
        pytest.skip(f"this model's prefix cache is off ({live.state.prefix_reason})")
    url = data_url(png_bytes(picture(4)))
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    for _ in range(2):
        reply = live.openai().chat.completions.create(
            model="tiny-vlm", messages=[{"role": "user", "content": content}], max_tokens=2
        )
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
    cached = [
        live.openai()
        .chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": QUESTION}], max_tokens=2)
        .usage.prompt_tokens_details.cached_tokens
        for _ in range(2)
    ]
    assert cached[0] == 0 and cached[1] > 0


def test_bad_pictures_are_400_in_each_apis_shape(served, pictures):
    live, _ = served
    http = live.http()
    tiff = data_url((pictures / "c.tiff").read_bytes(), "image/tiff")
    png = data_url(png_bytes(picture(5)))
    cases = [
        ("https://example.com/cat.png", "does not fetch"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "does not decode as an image"),
        ("data:image/png;base64,%%%", "not valid base64"),
        (tiff, "TIFF image, which is not supported"),
        ("/nonexistent/cat.png", "cannot read image file"),
    ]
    for url, words in cases:
        body = {
            "model": "tiny-vlm",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        }
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (
            error["type"] == "invalid_request_error"
            and error["param"] == "messages[0].content"
            and words in error["message"]
        ), error
    many = [{"type": "image_url", "image_url": {"url": png}}] * (MAX_IMAGES + 1)
    response = http.post(
        "/v1/chat/completions",
        json={"model": "tiny-vlm", "max_tokens": 2, "messages": [{"role": "user", "content": many}]},
    )
    assert response.status_code == 400 and f"at most {MAX_IMAGES}" in response.json()["error"]["message"], response.text
    for source, words in [
        ({"type": "url", "url": "http://10.0.0.1/x.png"}, "does not fetch"),
        ({"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}, "does not decode"),
        ({"type": "file", "file_id": "f"}, "must be base64 or url"),
    ]:
        body = {
            "model": "tiny-vlm",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
        }
        response = http.post("/v1/messages", json=body)
        assert response.status_code == 400 and response.json()["type"] == "error", response.text
        assert words in response.json()["error"]["message"], response.text
    # the server still serves
    assert (
        live.openai()
        .chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        .choices
    )
