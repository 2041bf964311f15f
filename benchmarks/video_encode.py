"""What a video costs the encoder, per second of video, and what the encoder cache saves on a repeat.

An encoder engine of the preset (the encoder tier's own engine, in this process) encodes distinct
videos of each length (PyAV decode of the sampled frames, resize, patches, the vision tower), then
the same videos again (cache hits). Prints per length: the header probe, the encode, the encode per
second of video, and the repeat's cost as a ratio of the first.

    python benchmarks/video_encode.py [--model small-qwen2-vl] [--seconds 2,4,8] [--side 448] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd.bench.workload import render_video  # noqa: E402
from epd.config import EncoderConfig  # noqa: E402
from epd.encoder.engine import EncoderEngine  # noqa: E402
from epd.models.locate import resolve_model  # noqa: E402
from epd.multimodal.video import probe_video, video_geometry_from_bytes  # noqa: E402

SOURCE_FPS = 10  # lossless noise frames are large: 8 s of 448x336 at 10 fps is 36 MB (the limit is 48)


def encode_s(engine: EncoderEngine, request_id: str, video: bytes) -> float:
    item = engine.make_item(video, modality="video")
    start = time.perf_counter()
    engine.submit(request_id, [item], hold_until_release=False).result(timeout=600)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-qwen2-vl")
    parser.add_argument("--seconds", default="2,4,8")
    parser.add_argument("--side", type=int, default=448, help="frame width (height 3/4 of it)")
    parser.add_argument("--repeats", type=int, default=3, help="distinct videos per length (median)")
    args = parser.parse_args()
    engine = EncoderEngine.from_model_dir(resolve_model(args.model), EncoderConfig())
    sampling = engine.media.video
    print(f"{args.model}: sampling {sampling.fps:g} fps, {sampling.min_frames}-{sampling.max_frames} frames, "
          f"frames within {sampling.geometry.min_pixels}-{sampling.geometry.max_pixels} px; source {SOURCE_FPS} fps "
          f"{args.side}x{args.side * 3 // 4}")
    encode_s(engine, "warm-up", render_video(SOURCE_FPS, SOURCE_FPS, args.side, args.side * 3 // 4, seed=999))
    print(f"{'video s':>8} {'frames':>7} {'rows':>6} {'probe ms':>9} {'encode ms':>10} {'ms per video s':>15} "
          f"{'repeat ms':>10} {'repeat/first':>13}")
    try:
        for seconds in map(float, args.seconds.split(",")):
            videos = [render_video(int(seconds * SOURCE_FPS), SOURCE_FPS, args.side, args.side * 3 // 4,
                                   seed=100 * int(seconds) + r) for r in range(args.repeats)]
            probe = statistics.median(_timed(lambda v=v: probe_video(v)) for v in videos)
            first = statistics.median(encode_s(engine, f"a{seconds}-{r}", v) for r, v in enumerate(videos))
            again = statistics.median(encode_s(engine, f"b{seconds}-{r}", v) for r, v in enumerate(videos))
            geo = video_geometry_from_bytes(videos[0], sampling)
            print(f"{seconds:>8g} {len(geo.frames_indices):>7} {geo.num_embedding_rows:>6} {probe * 1e3:>9.1f} "
                  f"{first * 1e3:>10.1f} {first * 1e3 / seconds:>15.1f} {again * 1e3:>10.2f} {again / first:>13.4f}")
    finally:
        engine.close()
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
