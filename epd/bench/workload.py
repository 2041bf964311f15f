"""Synthetic workloads for ``epd bench``: text prompts of about L tokens, locally generated images
(gradients or noise) of weighted sizes with a repeat ratio that re-sends earlier images, and
Poisson / gamma arrival times. Everything is a function of the seed."""
from __future__ import annotations

import ast
import base64
import io
import math
from dataclasses import dataclass, field

import numpy as np

# Common English words that are one token each (with their leading space) in BPE vocabularies
# such as Qwen2's, so a prompt of L words is about L tokens.
WORDS = tuple("""
the of and to in is that for it as was with be by on not he this are or his from at which but
have an they you were her she there one all we their has been if more when will would who so no
can out up what about into than them some could only time other new these two may first then do
any like my now over such our man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state good
very make world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take
three states himself few house use during without again place around however home small found mrs
thought went say part once general high upon school every don does got united left number course war
until always away something fact though water less public put think almost hand enough far took head
yet government system better set told nothing night end why called eyes find going look asked later
knew point next program city business give group toward young days let room president side social
given present several order national possible rather second face per among form important often things
early white case john become large big need four within felt along children saw best church ever
least power development light thing seemed family interest want members mind country area others done
turned although open problem god service certain kind different thus began door help means sense whole
matter perhaps itself york times law human line above name example action company hands local show
whether five history gave today either act feet across taken past quite anything seen having death
week experience body word half really field car words already themselves information tell together
college shall money period held keep sure real probably free seems political cannot behind miss question
air office making brought whose special heard major problems ago became federal moment study available
known result street economic boy position reason change south board individual job areas society west
close turn love community true court force full seem am age voice center woman control common policy
necessary front sometimes six girl clear further land run students provide able feel party music
""".split())


@dataclass(frozen=True)
class ImageSize:
    width: int
    height: int
    weight: float = 1.0


@dataclass(frozen=True)
class ImageSpec:
    """One image of a request: its geometry and the seed its pixels come from. Two specs with the
    same (width, height, kind, seed) are the same bytes, hence the same encoder-cache entry."""

    width: int
    height: int
    seed: int
    kind: str = "gradient"
    repeated: bool = False  # a re-send of an earlier image (the repeat ratio's draw)

    @property
    def key(self) -> tuple[int, int, str, int]:
        return (self.width, self.height, self.kind, self.seed)


@dataclass
class RequestSpec:
    index: int
    prompt: str
    images: list[ImageSpec]  # synthetic images, rendered into image_inputs; a dataset's come as inputs
    output_len: int
    arrival_s: float  # when to send, seconds after the run starts
    # what is sent, in order: encoded image bytes, or a URL the server fetches (http(s), data:)
    image_inputs: list[bytes | str] = field(default_factory=list, repr=False)  # render_images() fills synthetic
    repeated_inputs: int = 0  # a dataset's images that an earlier request of it sent too

    @property
    def num_images(self) -> int:
        return len(self.images) or len(self.image_inputs)

    @property
    def num_repeated_images(self) -> int:
        return sum(1 for im in self.images if im.repeated) + self.repeated_inputs


# ---- parsing ------------------------------------------------------------------------------------

def parse_image_sizes(spec: str) -> list[ImageSize]:
    """``"448x448"``, ``"224x224:3,896x672:1"`` -> sizes with weights (default 1)."""
    sizes = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        geometry, _, weight = part.partition(":")
        try:
            w, h = (int(v) for v in geometry.lower().split("x"))
            wt = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"bad image size {part!r}: expected WxH or WxH:weight, e.g. 448x448:2") from None
        if w < 1 or h < 1 or not (wt > 0 and math.isfinite(wt)):
            raise ValueError(f"bad image size {part!r}: width, height and weight must be positive")
        sizes.append(ImageSize(w, h, wt))
    if not sizes:
        raise ValueError(f"no image size in {spec!r}")
    return sizes


def parse_bucket_config(spec: str) -> list[ImageSize]:
    """vLLM's ``--random-mm-bucket-config``: ``"{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"``, a
    mapping of (height, width, frames) to probability, read as a Python literal (never evaluated)
    -> image sizes with those weights. Frames other than 1 are videos, which EPD does not serve."""
    try:
        buckets = ast.literal_eval(spec.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"bad bucket config {spec!r}: expected {{(height, width, frames): probability, ...}}") \
            from None
    if not isinstance(buckets, dict) or not buckets:
        raise ValueError(f"bad bucket config {spec!r}: expected a non-empty {{(height, width, frames): probability}}")
    sizes = []
    for key, weight in buckets.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) and v > 0 for v in key)):
            raise ValueError(f"bad bucket {key!r}: expected (height, width, frames) of positive ints")
        if key[2] != 1:
            raise ValueError(f"bucket {key!r} has {key[2]} frames: a video; only images (frames 1) are served")
        if not (isinstance(weight, (int, float)) and weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"bucket {key!r}: probability must be a number >= 0, got {weight!r}")
        if weight > 0:
            sizes.append(ImageSize(width=key[1], height=key[0], weight=float(weight)))
    if not sizes:
        raise ValueError(f"bad bucket config {spec!r}: every probability is 0")
    return sizes


def parse_rates(spec: str) -> list[float]:
    """``"inf"``, ``"4"``, ``"1,2,4,inf"`` -> request rates in requests/s (inf: all at once)."""
    rates = []
    for part in (p.strip().lower() for p in str(spec).split(",")):
        if not part:
            continue
        try:
            rate = math.inf if part in ("inf", "infinity") else float(part)
        except ValueError:
            raise ValueError(f"bad request rate {part!r}: a number of requests/s or 'inf'") from None
        if not rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError(f"no request rate in {spec!r}")
    return rates


# ---- arrivals -----------------------------------------------------------------------------------

def arrival_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` gaps between requests: gamma with shape ``burstiness`` and mean ``1/rate`` (shape 1 is
    a Poisson process; < 1 is burstier, > 1 more regular: the coefficient of variation is
    1/sqrt(burstiness)). ``rate`` inf: all zero (everything at once)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send offsets in seconds; the first request goes at 0."""
    gaps = arrival_intervals(n, rate, burstiness, rng)
    if n:
        gaps[0] = 0.0
    return np.cumsum(gaps)


# ---- prompts and images -------------------------------------------------------------------------

def make_prompt(num_words: int, rng: np.random.Generator) -> str:
    """About ``num_words`` tokens of text (one word is about one token)."""
    idx = rng.integers(0, len(WORDS), size=max(1, num_words))
    return " ".join(WORDS[i] for i in idx)


def spread(base: int, range_ratio: float, n: int, rng: np.random.Generator, *, low: int = 1) -> list[int]:
    """``n`` integers drawn uniformly from [base * (1 - r), base * (1 + r)] (rounded inwards, at
    least ``low``), vLLM's ``--random-range-ratio`` rule; ``r`` 0: all ``base``."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(low, math.ceil(base * (1 - range_ratio))), max(low, math.floor(base * (1 + range_ratio)))
    return [base] * n if range_ratio == 0 else [int(v) for v in rng.integers(lo, hi + 1, size=n)]


def choose_images(num_requests: int, per_request: int | list[int], sizes: list[ImageSize], repeat_ratio: float,
                  rng: np.random.Generator, *, seed_base: int = 0, kind: str = "gradient") -> list[list[ImageSpec]]:
    """Each slot re-sends an earlier image with probability ``repeat_ratio`` (when there is one),
    else draws a new one whose size is picked by weight. ``per_request``: images per request, one
    count for all or one per request."""
    if not 0.0 <= repeat_ratio <= 1.0:
        raise ValueError(f"repeat ratio must be in [0, 1], got {repeat_ratio}")
    counts = [per_request] * num_requests if isinstance(per_request, int) else list(per_request)
    probs = np.array([s.weight for s in sizes], dtype=float)
    probs /= probs.sum()
    seen: list[ImageSpec] = []
    out = []
    for count in counts:
        images = []
        for _ in range(count):
            if seen and rng.random() < repeat_ratio:
                old = seen[int(rng.integers(0, len(seen)))]
                images.append(ImageSpec(old.width, old.height, old.seed, old.kind, repeated=True))
            else:
                size = sizes[int(rng.choice(len(sizes), p=probs))]
                spec = ImageSpec(size.width, size.height, seed_base + len(seen), kind)
                seen.append(spec)
                images.append(spec)
        out.append(images)
    return out


def render_image(spec: ImageSpec) -> bytes:
    """PNG bytes of the image a spec names (deterministic). ``gradient``: a smooth two-colour
    gradient with a few seeded rectangles (distinct content, small files); ``noise``: uniform
    noise (every patch differs; large, incompressible files)."""
    rng = np.random.default_rng([spec.seed, spec.width, spec.height])
    w, h = spec.width, spec.height
    if spec.kind == "noise":
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    elif spec.kind == "gradient":
        angle = rng.uniform(0, 2 * math.pi)
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
        t = xs * math.cos(angle) / max(w, 1) + ys * math.sin(angle) / max(h, 1)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        c0, c1 = rng.uniform(0, 255, size=3), rng.uniform(0, 255, size=3)
        pixels = (c0 + t[..., None] * (c1 - c0)).astype(np.uint8)
        for _ in range(int(rng.integers(3, 7))):
            x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
            x1, y1 = x0 + int(rng.integers(1, max(2, w // 3))), y0 + int(rng.integers(1, max(2, h // 3)))
            pixels[y0:y1, x0:x1] = rng.integers(0, 256, size=3, dtype=np.uint8)
    else:
        raise ValueError(f"unknown image kind {spec.kind!r}: gradient or noise")
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def render_video(num_frames: int, fps: float, width: int, height: int, *, seed: int = 0,
                 frames: list[np.ndarray] | None = None) -> bytes:
    """A lossless video (FFV1 in Matroska: decoded frames equal the frames written) of a bright
    square moving over seeded noise (every patch differs), or of the ``frames`` given."""
    from epd.multimodal.video import frames_to_video

    if frames is None:
        background = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        frames = []
        for i in range(num_frames):
            frame = background.copy()
            x = (i * 5) % max(1, width - 16)
            frame[8:24, x:x + 16] = (255, 255 - 20 * (i % 10), 40)
            frames.append(frame)
    return frames_to_video(frames, fps)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# ---- the whole workload -------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadConfig:
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    images_per_request: int = 1
    image_sizes: tuple[ImageSize, ...] = (ImageSize(448, 448),)
    image_kind: str = "gradient"
    repeat_ratio: float = 0.0
    seed: int = 0
    range_ratio: float = 0.0  # input and output lengths spread by this ratio (vLLM's --random-range-ratio)
    items_range_ratio: float = 0.0  # images per request spread by this ratio (--random-mm-num-mm-items-range-ratio)

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")
        if self.images_per_request < 0:
            raise ValueError(f"images_per_request must be >= 0, got {self.images_per_request}")
        if self.image_kind not in ("gradient", "noise"):
            raise ValueError(f"image kind must be gradient or noise, got {self.image_kind!r}")
        if not 0.0 <= self.repeat_ratio <= 1.0:
            raise ValueError(f"repeat ratio must be in [0, 1], got {self.repeat_ratio}")
        for name in ("range_ratio", "items_range_ratio"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


def build_workload(cfg: WorkloadConfig, rate: float, burstiness: float, *, run_index: int = 0) -> list[RequestSpec]:
    """The requests of one run. ``run_index`` (one per rate of a sweep) changes the prompts and
    images, so a later run does not hit caches warmed by an earlier one."""
    rng = np.random.default_rng([cfg.seed, run_index])
    arrivals = arrival_times(cfg.num_prompts, rate, burstiness, np.random.default_rng([cfg.seed, run_index, 1]))
    lengths = np.random.default_rng([cfg.seed, run_index, 3])
    input_lens = spread(cfg.input_len, cfg.range_ratio, cfg.num_prompts, lengths)
    output_lens = spread(cfg.output_len, cfg.range_ratio, cfg.num_prompts, lengths)
    counts = spread(cfg.images_per_request, cfg.items_range_ratio, cfg.num_prompts, lengths, low=0)
    images = choose_images(cfg.num_prompts, counts, list(cfg.image_sizes), cfg.repeat_ratio,
                           np.random.default_rng([cfg.seed, run_index, 2]),
                           seed_base=(cfg.seed * 1000 + run_index) * 1_000_000, kind=cfg.image_kind)
    return [RequestSpec(index=i, prompt=make_prompt(input_lens[i], rng), images=images[i],
                        output_len=output_lens[i], arrival_s=float(arrivals[i])) for i in range(cfg.num_prompts)]


def render_images(requests: list[RequestSpec]) -> int:
    """Fill each synthetic request's ``image_inputs``; a repeated image shares the bytes rendered
    once. Returns the number of distinct bytes held (a dataset's inputs counted as they are)."""
    cache: dict[tuple, bytes] = {}
    given: dict[int, int] = {}
    for req in requests:
        if not req.images:  # a dataset's request: its inputs are already there
            given.update((id(x), len(x)) for x in req.image_inputs if isinstance(x, bytes))
            continue
        req.image_inputs = []
        for im in req.images:
            data = cache.get(im.key)
            if data is None:
                data = cache[im.key] = render_image(im)
            req.image_inputs.append(data)
    return sum(len(b) for b in cache.values()) + sum(given.values())
