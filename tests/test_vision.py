"""The vision library (mlxlab/vision): image checks, stable ids and the filename table, and the
tiny random-init VLMs served through mlx-vlm, token for token against mlx-vlm's own generate."""

from __future__ import annotations

import pytest

from mlxlab.vision import images, prompt
from tests.helpers.images import encoded, gif_two_frames, jpeg_with_exif, picture

# --- images ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_accepted_format_decodes_to_rgb_with_its_hash(fmt):
    data = encoded(2, fmt)
    pic = images.decode(data, f"image/{fmt.lower()}")
    assert pic.format == fmt and pic.image.mode == "RGB" and pic.image.size == (56, 40)
    assert pic.digest == images.digest_of(data) and len(pic.digest) == 64
    assert pic.filename == f"image_{pic.digest[:8]}.{fmt.lower()}"


def test_a_gif_gives_its_first_frame():
    pic = images.decode(gif_two_frames(), "image/gif")
    assert pic.image.getpixel((3, 3)) == (255, 0, 0)


@pytest.mark.parametrize(
    "data,declared,status,code",
    [
        (encoded(0, "PNG")[:-40], "image/png", 400, "invalid_image"),  # truncated PNG
        (encoded(0, "JPEG")[:300], "image/jpeg", 400, "invalid_image"),  # truncated JPEG
        (encoded(0, "PNG"), "image/jpeg", 400, "image_type_mismatch"),  # wrong MIME
        (encoded(0, "PNG"), "text/plain", 400, "image_type_mismatch"),
        (encoded(0, "BMP"), None, 400, "unsupported_image_format"),
        (encoded(0, "TIFF"), None, 400, "unsupported_image_format"),
        (b"GIF89a not really", None, 400, "invalid_image"),
        (b"hello world", None, 400, "invalid_image"),
        (b"", None, 400, "invalid_image"),
    ],
)
def test_bad_images_are_refused_with_their_reason(data, declared, status, code):
    with pytest.raises(images.ImageError) as e:
        images.decode(data, declared, "messages[0].content[1]")
    assert (e.value.status, e.value.code) == (status, code), str(e.value)
    assert str(e.value).startswith("messages[0].content[1]: ")


def test_too_many_pixels_is_a_413():
    with pytest.raises(images.ImageError) as e:
        images.decode(encoded(0, "PNG", size=(100, 100)), max_pixels=5000)
    assert e.value.status == 413 and "100 x 100 pixels" in str(e.value)


def test_exif_metadata_and_aliases():
    pic = images.decode(jpeg_with_exif(), "image/jpg")  # image/jpg: an alias of image/jpeg
    assert pic.meta == {
        "date": "2024-06-15",
        "camera": "Apple iPhone 14",
        "location": "34.0522°N, 118.2437°W",
    }
    assert images.decode(encoded(1, "PNG")).meta == {}


# --- ids and the table -----------------------------------------------------------------------


def _user(*digests, text="look"):
    parts = [{"type": "text", "text": text}]
    parts += [prompt.image_part(f"m.{d}", digest=d * 8) for d in digests]
    return {"role": "user", "content": parts}


def _pic(d: str, fmt="PNG", meta=None):
    return images.Picture(picture(0), d * 8, fmt, 10, meta or {})


def test_ids_follow_first_appearance_and_survive_reuploads():
    a, b, c = "a", "b", "c"
    convo = [_user(a), {"role": "assistant", "content": "x"}, _user(b, a)]
    ids = prompt.assign_ids(convo)
    assert ids == {"aaaaaaaa": 1, "bbbbbbbb": 2}
    convo += [{"role": "assistant", "content": "y"}, _user(c, a)]
    assert prompt.assign_ids(convo) == {"aaaaaaaa": 1, "bbbbbbbb": 2, "cccccccc": 3}


def test_tables_restore_ids_when_the_bytes_were_dropped():
    table = prompt.render_table([(1, _pic("a"), "beach.jpg"), (2, _pic("b", "JPEG"), None)])
    assert prompt.TABLE_MARK in table and "| 1 | image_aaaaaaaa.png | beach.jpg |" in table
    assert prompt.table_rows(table) == [(1, "aaaaaaaa"), (2, "bbbbbbbb")]
    convo = [
        {"role": "user", "content": "describe"},  # its images dropped by the client
        {"role": "assistant", "content": table + "A beach."},
        {"role": "user", "content": "what colour?"},
        {"role": "assistant", "content": "Blue."},
        _user("c", "b"),
    ]
    assert prompt.assign_ids(convo) == {"aaaaaaaa": 1, "bbbbbbbb": 2, "cccccccc": 3}
    seen = prompt.model_messages(convo, prompt.assign_ids(convo), prompt.images_in(convo[4]))
    assert seen[1]["content"] == "A beach." and prompt.TABLE_MARK not in str(seen)
    assert seen[4]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "text", "text": "[Image 3]"},
        {"type": "image"},
        {"type": "text", "text": "[Image 2]"},
        {"type": "image"},
    ]


def test_only_the_last_user_message_keeps_pixels():
    convo = [_user("a"), {"role": "assistant", "content": "ok"}, _user("b")]
    ids = prompt.assign_ids(convo)
    seen = prompt.model_messages(convo, ids, prompt.images_in(convo[2]))
    assert seen[0]["content"] == "look[Image 1]"
    assert {"type": "image"} in seen[2]["content"]
    text_only = prompt.model_messages(convo, ids)
    assert text_only[2]["content"] == "look[Image 2]"
    # parts that carry only their hash (a stored conversation's) are not images to show
    assert not prompt.has_payload(convo[2]["content"][1])
    assert prompt.has_payload(prompt.image_part("w", url="data:image/png;base64,AA=="))


def test_table_without_exif_columns():
    meta = {"date": "2024-06-15", "camera": "X|Y", "location": "1.0000°N, 2.0000°E"}
    full = prompt.render_table([(4, _pic("d", meta=meta), "a|b.png")])
    assert (
        "| 4 | image_dddddddd.png | a/b.png | 📍 1.0000°N, 2.0000°E | 📅 2024-06-15 | X/Y |" in full
    )
    bare = prompt.render_table([(4, _pic("d", meta=meta), "a.png")], exif=False)
    assert "| Image | Filename |\n" in bare and "2024" not in bare and "a.png" not in bare
    assert prompt.table_rows(bare) == [(4, "dddddddd")]
    assert prompt.strip_tables(bare + "Answer.") == "Answer."


# --- tiny VLMs through mlx-vlm ---------------------------------------------------------------

FAMILIES = {"gemma3": "gemma3-vl", "qwen2": "qwen2-vl", "qwen2.5": "qwen2.5-vl"}
FAMILIES["paligemma"] = "paligemma"  # mlx-lm has no class for it: mlx-vlm alone


@pytest.fixture(scope="module")
def loaded_vlms(tiny_dir):
    from mlxlab.vision import model

    return {fam: model.load(str(tiny_dir(name))) for fam, name in FAMILIES.items()}


def test_each_tiny_vlm_shares_its_language_weights(loaded_vlms):
    from mlxlab.vision.model import TextView

    for family, (text_model, tokenizer, vision) in loaded_vlms.items():
        assert vision.bytes_per_image > 0 and vision.reference_tokens > 0
        if family == "paligemma":  # one model, mlx-vlm's, seen through a TextView
            assert vision.alone and isinstance(text_model, TextView) and vision.shared_bytes == 0
            assert text_model.language_model is vision.model.language_model
            assert not tokenizer.chat_template
            continue
        assert not vision.alone and vision.shared_bytes > vision.own_bytes > 0
        assert vision.extra_bytes == vision.own_bytes
        assert tokenizer.chat_template  # the Qwen ones only from chat_template.json


# gemma3 and qwen2 are held to it through the server (test_serve_vision.py)
@pytest.mark.parametrize("family", ["qwen2.5", "paligemma"])
def test_vision_steps_equal_mlx_vlm_generate(family, loaded_vlms, tiny_dir, tmp_path):
    """Our wrapping of mlx-vlm (shared language weights, processor on PIL pictures, our sampler)
    gives mlx-vlm's own generate's greedy tokens on the same model, image file and prompt."""
    from mlx_lm.sample_utils import make_sampler
    from mlx_vlm import generate
    from mlx_vlm import load as vlm_load

    text_model, tokenizer, vision = loaded_vlms[family]
    ref_model, processor = vlm_load(str(tiny_dir(FAMILIES[family])))
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image"}]}
    ]
    text = vision.render(messages, tokenizer)
    outs = []
    for kind in (0, 2):
        path = tmp_path / f"{kind}.png"
        path.write_bytes(encoded(kind))
        pic = images.decode(path.read_bytes(), "image/png")
        inputs = vision.inputs(text, [pic.image])
        assert inputs.image_tokens > 0 and inputs.n_images == 1
        ours = [t for t, _ in vision.steps(inputs, make_sampler(temp=0.0), [], 12, 512)]
        ref = generate(ref_model, processor, text, image=[str(path)], max_tokens=12, temperature=0)
        n = len(ref.token_ids)  # mlx-vlm stops at an end token; ours runs to max_tokens
        assert ours[:n] == ref.token_ids and (n == 12 or ours[n] in tokenizer.eos_token_ids)
        outs.append(ours)
    assert outs[0] != outs[1], "the image does not reach the model"


def test_a_text_model_loads_without_vision(tiny_dir):
    from mlxlab.vision import model

    assert model.load(str(tiny_dir("gemma3")))[2] is None
    assert not model.is_vlm(tiny_dir("gemma3")) and model.is_vlm(tiny_dir("gemma3-vl"))
