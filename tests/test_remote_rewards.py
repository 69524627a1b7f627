"""Remote rewards on loopback: the client against a misbehaving stub server (slow, 500, wrong count, dying), the real
``trl-dance serve-reward`` process, and a GRPO run scored remotely that equals the in-process run."""

import http.server
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import tiny_grpo_config
from datasets import Dataset

from trl_dance import DanceGRPOTrainer
from trl_dance.rewards import RemoteReward, RemoteRewardError, brightness, get_reward_function, score_images
from trl_dance.rewards.remote import decode_image, encode_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Stub(http.server.ThreadingHTTPServer):
    """A reward server whose ``behave(request_number, body)`` decides each answer: (status, payload), in JSON or,
    with ``codec=pickle``, pickled as the ddpo-pytorch / Flow-GRPO servers do."""

    daemon_threads = True

    def __init__(self, behave, codec=json):
        self.behave, self.requests, self.bodies = behave, 0, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(handler):  # noqa: N805
                body = codec.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
                self.requests += 1
                self.bodies.append(body)
                answer = self.behave(self.requests, body)
                if answer is None:  # die in the middle of the answer: half the body, then the connection closes
                    handler.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"rewards": [0.')
                    handler.close_connection = True
                    return
                status, payload = answer
                data = codec.dumps(payload)
                data = data.encode() if isinstance(data, str) else data
                handler.send_response(status)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


def _brightness_answer(body):
    images = [decode_image(item, body["image_format"]) for item in body["images"]]
    return 200, {"rewards": [image.mean().item() for image in images]}


def test_images_round_trip_and_options_are_checked():
    image = torch.rand(3, 8, 8)
    assert torch.equal(decode_image(encode_image(image, "npy"), "npy"), image)  # exact
    assert (decode_image(encode_image(image, "png"), "png") - image).abs().max() <= 0.5 / 255 + 1e-6  # 8-bit
    video = torch.rand(2, 3, 8, 8)
    assert decode_image(encode_image(video, "png"), "png").shape == (2, 3, 8, 8)
    with pytest.raises(ValueError, match="needs an http\\(s\\) URL"):
        RemoteReward("localhost:8000")
    with pytest.raises(ValueError, match="image_format must be one of"):
        RemoteReward("http://localhost:8000", image_format="webp")
    reward = get_reward_function("http://127.0.0.1:9/", batch_size=2)  # a URL in reward_funcs, options in kwargs
    assert isinstance(reward, RemoteReward) and reward.__name__ == "remote_127.0.0.1_9" and reward.batch_size == 2


def test_client_batches_concurrently_and_survives_a_slow_server():
    """A request that times out is retried; batches are split and reassembled in order."""

    def behave(number, body):
        if number == 1:
            time.sleep(1.5)  # longer than the client's timeout: it gives up and retries
        return _brightness_answer(body)

    stub = _Stub(behave)
    reward = RemoteReward(stub.url, batch_size=3, max_concurrency=1, timeout=0.5, max_retries=2, backoff=0.01)
    images = torch.rand(7, 3, 8, 8)
    values = reward(["p"] * 7, images, tag=list(range(7)))
    torch.testing.assert_close(torch.tensor(values), images.mean(dim=(1, 2, 3)), atol=1 / 255, rtol=0)
    assert stub.requests == 4  # 3 batches + 1 retry
    stub.shutdown()


@pytest.mark.parametrize(
    ("behave", "message"),
    [
        (
            lambda n, body: (500, {"error": "model exploded"}),
            r"batch 0 \(samples 0–3\): failed after 3 attempts; last: status 500: .*model exploded",
        ),
        (lambda n, body: (200, {"rewards": [0.5]}), r"batch 0 \(samples 0–3\): 1 rewards for 4 samples"),
        (lambda n, body: (200, {"scores": [0.5] * 4}), "the answer has no 'rewards' list"),
        (lambda n, body: (400, {"error": "no such column"}), "status 400: .*no such column"),
        (lambda n, body: (200, {"rewards": ["high", 1, 2, 3]}), "rewards must be numbers or null"),
        (lambda n, body: None, r"failed after 3 attempts; last: RemoteProtocolError"),  # dies mid-answer
        (
            lambda n, body: time.sleep(3) or _brightness_answer(body),
            r"failed after 3 attempts; last: no answer within",
        ),
    ],
)
def test_client_errors_name_the_server_the_status_and_the_batch(behave, message):
    """Every fault is a RemoteRewardError after bounded retries, never a hang or a silent value."""
    stub = _Stub(behave)
    reward = RemoteReward(stub.url, batch_size=4, timeout=0.5, max_retries=2, backoff=0.01)
    with pytest.raises(
        RemoteRewardError, match=f"reward server {stub.url}, {message}" if "batch" in message else message
    ):
        reward(["p"] * 4, torch.rand(4, 3, 8, 8))
    stub.shutdown()


def test_client_fails_clearly_when_the_server_dies_mid_run():
    stub = _Stub(lambda n, body: _brightness_answer(body))
    reward = RemoteReward(stub.url, batch_size=2, max_concurrency=1, timeout=1, max_retries=2, backoff=0.01)
    assert len(reward(["p"] * 2, torch.rand(2, 3, 8, 8))) == 2
    stub.shutdown()
    stub.server_close()
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"failed after 3 attempts; last: ConnectError"):
        reward(["p"] * 2, torch.rand(2, 3, 8, 8))
    assert time.monotonic() - start < 10  # bounded: no hang


def test_a_reward_url_with_nothing_listening_fails_when_the_trainer_is_built():
    """Probed when rewards are resolved (before any model work), within the reward's timeout."""
    from trl_dance.rewards import resolve_reward_funcs

    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=f"nothing answers at {url}.*trl-dance serve-reward"):
        resolve_reward_funcs([url], {url: {"timeout": 1}})
    assert time.monotonic() - start < 10


def test_serve_reward_exits_naming_a_reward_that_cannot_score():
    """A server that would answer /health "ok" and then fail every /score is not started."""
    port = _free_port()
    command = [sys.executable, "-m", "trl_dance.cli", "serve-reward", "hpsv2", "--port", str(port),
               "--reward_kwargs", '{"checkpoint": "/no/such/HPS_v2.1.pt"}']  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "reward 'hpsv2' failed on a test image, so nothing is served" in result.stderr
    assert "no such file or directory '/no/such/HPS_v2.1.pt'" in result.stderr


def _serve(reward: str, *options: str, token: str | None = None):
    """``trl-dance serve-reward REWARD OPTIONS`` as a real server process on loopback: (process, client)."""
    port = _free_port()
    command = [sys.executable, "-m", "trl_dance.cli", "serve-reward", reward, "--port", str(port), *options]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    client = RemoteReward(f"http://127.0.0.1:{port}", image_format="npy", timeout=5, max_retries=0, token=token)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.health()
            return process, client
        except RemoteRewardError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the reward server did not start: {process.communicate()[1][-2000:]}") from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def served_brightness():
    """``trl-dance serve-reward brightness`` with its default limits."""
    process, reward = _serve("brightness")
    assert reward.health()["reward"] == "brightness"
    started = process.stdout.readline()  # what it printed when it started listening
    assert (
        started.startswith("serving reward 'brightness' at http://127.0.0.1:") and "test image scored 0.5" in started
    )
    reward.process = process
    yield reward
    process.terminate()
    process.wait(timeout=30)


def test_served_reward_equals_in_process(served_brightness):
    images = torch.rand(5, 3, 16, 16)
    assert served_brightness(["a"] * 5, images) == brightness(["a"] * 5, images)  # npy: bit-exact
    png = RemoteReward(served_brightness.url, image_format="png")(["a"] * 5, images)
    quantized = (images * 255).round() / 255
    torch.testing.assert_close(torch.tensor(png), quantized.mean(dim=(1, 2, 3)), atol=1e-6, rtol=0)
    malformed = served_brightness.client.post(f"{served_brightness.url}/score", json={"prompts": ["a"]})
    assert malformed.status_code == 400 and "bad request: 1 prompts, 0 images" in malformed.json()["error"]
    with pytest.raises(RemoteRewardError, match="status 400: .*1 prompts, 0 images"):
        served_brightness._score_batch(0, 0, {"prompts": ["a"], "images": [], "image_format": "npy"})


def test_grpo_scored_by_the_served_reward_trains_like_in_process(tiny_model_dir, tmp_path, served_brightness):
    """Two rounds of GRPO with brightness served over HTTP (npy images) and in-process: the same rewards (to float32
    rounding: the server reduces a contiguous copy of each image) and the same LoRA to 1e-3 (measured 6.7e-5)."""
    from peft import LoraConfig

    runs = []
    for reward in (served_brightness.url, "brightness"):
        remote = reward.startswith("http")
        args = tiny_grpo_config(
            tmp_path / str(len(runs)),
            max_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            reward_kwargs={reward: {"image_format": "npy"}} if remote else None,
        )
        trainer = DanceGRPOTrainer(
            tiny_model_dir("flux"),
            reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a cat", "a dog", "a house", "a tree"]}),
            peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]),
        )
        trainer.train()
        rollout = trainer._rollout
        runs.append(
            (rollout["rewards"].cpu(), {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora" in k})
        )
        if remote:  # the served values are the in-process function's on the same images
            torch.testing.assert_close(
                rollout["rewards"].cpu(), rollout["images"].mean(dim=(1, 2, 3)), atol=1e-6, rtol=0
            )
    (remote_rewards, remote_lora), (local_rewards, local_lora) = runs
    torch.testing.assert_close(remote_rewards, local_rewards, atol=1e-6, rtol=0)
    assert max((remote_lora[k] - local_lora[k]).abs().max().item() for k in local_lora) < 1e-3


def _chat_stub(answer):
    """An OpenAI-compatible chat-completions stub: ``answer(brightnesses of the message's images)`` is its reply."""

    def behave(number, body):
        content = body["messages"][0]["content"]
        urls = [part["image_url"]["url"] for part in content if part["type"] == "image_url"]
        values = [decode_image(url.split(",", 1)[1], "png").mean().item() for url in urls]
        return 200, {"choices": [{"message": {"role": "assistant", "content": answer(values)}}]}

    return _Stub(behave)


def test_pointwise_judge_parses_the_final_score():
    from trl_dance.rewards import PointwiseJudge

    stub = _chat_stub(lambda v: f"Bright enough. Final Score: {1 + 4 * v[0]:.4f}" if v[0] > 0.3 else "I cannot tell.")
    judge = get_reward_function("vlm_judge", base_url=f"{stub.url}/v1", model="stub", backoff=0.01)
    assert isinstance(judge, PointwiseJudge)
    images = torch.stack([torch.full((3, 8, 8), value) for value in (0.2, 0.4, 0.8)])  # 8-bit exact
    logged = {}
    scores = judge(["a"] * 3, images, log_metric=logged.__setitem__)
    assert scores[0] is None and scores[1:] == pytest.approx([1 + 4 * 0.4, 1 + 4 * 0.8], abs=1e-4)
    assert logged == {"vlm_judge/unparsed": pytest.approx(1 / 3)}
    stub.shutdown()


def test_pairwise_judge_win_rates_and_position_bias():
    """A judge preferring the brighter image: win rate = the number of darker samples / (G − 1), as by hand. A judge
    that always prefers the first image: every pair asked in both orders, so every win rate is ½."""
    values = [0.6, 0.1, 0.9, 0.4]
    images = torch.stack([torch.full((3, 8, 8), value) for value in values])
    brighter = _chat_stub(lambda v: f"Final Answer: Image {1 if v[0] > v[1] else 2}")
    judge = get_reward_function("pairwise_judge", base_url=f"{brighter.url}/v1", model="stub", backoff=0.01)
    expected = [sum(other < value for other in values) / 3 for value in values]  # [2/3, 0, 1, 1/3]
    assert judge(["a"] * 4, images) == pytest.approx(expected)
    assert brighter.requests == 4 * 3  # every ordered pair
    biased = _chat_stub(lambda v: "Final Answer: Image 1")
    judge = get_reward_function("pairwise_judge", base_url=f"{biased.url}/v1", model="stub", backoff=0.01)
    assert judge(["a"] * 4, images) == [0.5] * 4
    scores = score_images([judge], ["a"] * 2 + ["b"] * 2, images, {}, groups=[0, 0, 1, 1])  # one call per group
    assert scores[:, 0].tolist() == [0.5] * 4 and biased.requests == 12 + 2 + 2
    with pytest.raises(ValueError, match="compares the samples of one prompt"):
        judge(["a", "b"], images[:2])
    brighter.shutdown()
    biased.shutdown()


def test_pickle_server_adapters_speak_the_reference_formats():
    """ddpo-pytorch's LLaVA-BERTScore and Flow-GRPO's DeQA / GenEval servers: the request dicts they pickle (JPEG
    images, queries, answers, metadata) and the fields their rewards come from."""
    from PIL import Image

    def jpeg_brightness(body):
        return [
            torch.tensor(list(Image.open(io.BytesIO(b)).getdata())).float().mean().item() / 255 for b in body["images"]
        ]

    llava = _Stub(
        lambda n, body: (
            200,
            {
                "recall": [[v] for v in jpeg_brightness(body)],
                "precision": [[0.5]] * len(body["images"]),
                "f1": [[0.25]] * len(body["images"]),
                "outputs": ["..."] * len(body["images"]),
            },
        ),
        codec=pickle,
    )
    images = torch.stack([torch.full((3, 16, 16), value) for value in (0.2, 0.6, 0.8)])
    logged = {}
    with pytest.raises(
        ValueError, match="unpickling runs whatever code the answer names; pass trust_remote_pickle=True"
    ):
        get_reward_function("llava_bertscore", url=llava.url)
    trust = {"trust_remote_pickle": True}
    reward = get_reward_function("llava_bertscore", url=llava.url, batch_size=2, backoff=0.01, **trust)
    values = reward(["a cat", "a dog", "a house"], images, log_metric=logged.__setitem__)
    assert values == pytest.approx([0.2, 0.6, 0.8], abs=2 / 255) and llava.requests == 2
    first = llava.bodies[0]
    assert first["queries"] == [["Answer concisely: what is going on in this image?"]] * 2
    assert first["answers"] == [["The image contains a cat"], ["The image contains a dog"]]
    assert logged == {"llava_bertscore/precision": 0.5, "llava_bertscore/f1": 0.25}

    deqa = _Stub(lambda n, body: (200, {"outputs": jpeg_brightness(body)}), codec=pickle)
    assert get_reward_function("deqa", url=deqa.url, **trust)(["x"] * 3, images) == pytest.approx(
        [0.2, 0.6, 0.8], abs=2 / 255
    )
    assert set(deqa.bodies[0]) == {"images"}

    answer = {
        "scores": [1.0, 0.5, 0.0],
        "rewards": [1, 1, 0],
        "strict_rewards": [1, 0, 0],
        "group_rewards": {},
        "group_strict_rewards": {},
    }
    geneval = _Stub(lambda n, body: (200, answer), codec=pickle)
    metadata = [{"tag": "counting", "include": [{"class": "cat", "count": 2}]}] * 3
    reward = get_reward_function("geneval", url=geneval.url, **trust)
    assert reward(["two cats"] * 3, images, metadata=metadata) == [1.0, 0.5, 0.0]
    assert geneval.bodies[0]["meta_datas"] == metadata and geneval.bodies[0]["only_strict"] is True
    with pytest.raises(ValueError, match="GenEval metadata in the dataset column 'metadata'"):
        reward(["two cats"] * 3, images)
    wrong = _Stub(lambda n, body: (200, {"outputs": [0.1]}), codec=pickle)
    with pytest.raises(RemoteRewardError, match="deqa server .*: 1 rewards for 3 samples"):
        get_reward_function("deqa", url=wrong.url, **trust)(["x"] * 3, images)
    for stub in (llava, deqa, geneval, wrong):
        stub.shutdown()


# ------------------------------------------------------------------------------------------------------------------
# The server under hostile input, faults and load (issue #42)


def _png(width: int, height: int) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return __import__("base64").b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def strict_server():
    """A server with a token, small limits and a queue of 1 in front of a reward that takes 0.3 s."""
    options = ["--token", "s3cret", "--max_images", "4", "--max_pixels", "4096", "--max_body_mb", "0.5"]
    options += ["--max_prompt_chars", "100", "--max_frames", "3", "--max_queue", "1"]
    process, client = _serve("slow_reward:slow_brightness", *options, token="s3cret")
    yield client
    process.terminate()
    process.wait(timeout=30)


def test_hostile_requests_get_clear_json_errors(strict_server):
    """Malformed items are 400s naming the item; limits are 413s naming the item and the limit, checked before the work
    they bound (a 100×100 PNG is refused from its header, a large body while it is read); no token, a 401."""
    url, headers = f"{strict_server.url}/score", {"Authorization": "Bearer s3cret"}
    post = strict_server.client.post
    good = {"prompts": ["a"], "images": [_png(8, 8)], "image_format": "png"}
    cases = [
        ({"prompts": ["a"], "images": ["%%% not base64"]}, 400, "images[0]: not base64"),
        ({"prompts": ["a"], "images": [__import__("base64").b64encode(b"not an image").decode()]}, 400,
         "images[0]: not a png image (UnidentifiedImageError"),
        ({"prompts": ["a"], "images": [7]}, 400, "images[0]: expected base64 text, got int"),
        ({"prompts": [3], "images": [_png(8, 8)]}, 400, "prompts[0]: expected text, got int"),
        ({"prompts": ["a"] * 5, "images": [_png(8, 8)] * 5}, 413, "5 images in one request (limit --max_images 4)"),
        ({"prompts": ["a"], "images": [_png(100, 100)]}, 413, "images[0]: 100×100 = 10000 pixels (limit --max_pixels 4096)"),
        ({"prompts": ["x" * 101], "images": [_png(8, 8)]}, 413, "prompts[0]: 101 characters (limit --max_prompt_chars 100)"),
        ({"prompts": ["a"], "images": [[_png(8, 8)] * 4]}, 413, "images[0]: a video of 4 frames (limit 3)"),
        ({"prompts": ["a"], "images": [_png(8, 8)], "image_format": "gif"}, 400, "image_format must be one of"),
        (good | {"columns": {"image": [{"image": "!!"}]}}, 400, "columns['image'][0]: not base64"),
    ]  # fmt: skip
    for payload, status, message in cases:
        response = post(url, json=payload, headers=headers)
        assert response.status_code == status and message in response.json()["error"], (message, response.text)
    response = post(url, content=b"{not json", headers=headers)
    assert response.status_code == 400 and "not JSON" in response.json()["error"]
    response = post(url, content=b"x" * (600 * 1024), headers=headers)  # over --max_body_mb 0.5
    assert response.status_code == 413 and "limit --max_body_mb" in response.json()["error"]
    import httpx

    for auth in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(url, json=good, headers=auth)  # not the client, which sends its token
        assert response.status_code == 401 and "token" in response.json()["error"]
    assert post(url, json=good, headers=headers).json() == {"rewards": [0.0]}
    assert strict_server(["a"], torch.full((1, 3, 8, 8), 0.5)) == [0.5]  # the client sends the token it was given
    # A wrong or missing token is found when the reward is built (its probe), at once, not at the first rollout.
    strict_server.probe(wait=0)
    for token in ("wrong", None):
        stranger = RemoteReward(strict_server.url, timeout=30, max_retries=0, token=token)
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match="refused the token .*401"):
            stranger.probe()
        assert time.monotonic() - started < 5  # no waiting out the 30 s for an answer that will not change


def test_a_full_queue_answers_503_and_clients_retry_after(strict_server):
    """--max_queue 1 and a 0.3 s reward: concurrent requests beyond the first get 503 with Retry-After at once (not
    queued without bound); clients that retry honour it and every answer is right; without retries the error names
    the server, the batch and the last status."""
    import httpx

    images = torch.rand(4, 3, 8, 8)
    payload = {"prompts": ["a"], "images": [encode_image(images[0], "npy")], "image_format": "npy"}
    auth = {"Authorization": "Bearer s3cret"}
    with httpx.Client(timeout=10) as client, __import__("concurrent.futures").futures.ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(lambda _: client.post(f"{strict_server.url}/score", json=payload, headers=auth), range(4))
        )
    busy = [r for r in responses if r.status_code == 503]
    assert busy and all(r.headers["retry-after"] == "1" and "--max_queue 1" in r.json()["error"] for r in busy)
    assert all(r.status_code in (200, 503) for r in responses)
    patient = RemoteReward(strict_server.url, image_format="npy", batch_size=1, max_concurrency=4, token="s3cret",
                           max_retries=6, backoff=0.05, timeout=10)  # fmt: skip
    assert patient(["a"] * 4, images) == pytest.approx(images.mean(dim=(1, 2, 3)).tolist(), abs=1e-6)
    impatient = RemoteReward(strict_server.url, image_format="npy", batch_size=1, max_concurrency=4, token="s3cret",
                             max_retries=0, timeout=10)  # fmt: skip
    with pytest.raises(
        RemoteRewardError,
        match=r"reward server .*, batch \d \(samples \d–\d\): failed after 1 attempts; last: status 503",
    ):
        impatient(["a"] * 4, images)


def test_load_answers_every_request_in_order_with_bounded_memory(served_brightness):
    """200 requests of 8 PNG images from 8 concurrent clients against the real server (default limits): every answer
    is its own images' brightness, in order; /health answers throughout; the server's resident memory grows by less
    than 200 MB; all within a minute."""
    import concurrent.futures

    def rss(pid: int) -> int:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    pid = served_brightness.process.pid
    before = rss(pid)
    client = RemoteReward(served_brightness.url, image_format="png", batch_size=8, max_concurrency=8, timeout=30)
    batches = [torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(25)]
    start, peak = time.monotonic(), before

    def one(i: int) -> tuple[int, list]:
        return i, client([f"prompt {i}"] * 64, torch.cat([batches[i % 25]] * 8))  # 8 requests of 8 images

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(25)]  # 25 calls × 8 requests = 200 requests
        while not all(f.done() for f in futures):
            assert served_brightness.health()["status"] == "ok"
            peak = max(peak, rss(pid))
            time.sleep(0.05)
        results = [f.result() for f in futures]
    elapsed = time.monotonic() - start
    for i, values in results:
        expected = ((torch.cat([batches[i % 25]] * 8) * 255).round() / 255).mean(dim=(1, 2, 3))
        torch.testing.assert_close(torch.tensor(values), expected, atol=1e-6, rtol=0)
    print(
        f"200 requests in {elapsed:.1f} s ({200 / elapsed:.0f}/s), server RSS {before / 2**20:.0f} → peak {peak / 2**20:.0f} MB"
    )
    assert elapsed < 60 and peak - before < 200 * 2**20
