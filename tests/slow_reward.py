"""A reward that takes its time (0.3 s per call): lets the server tests fill the server's queue."""

import time


def slow_brightness(prompts, images, **kwargs):
    time.sleep(0.3)
    return images.mean(dim=(1, 2, 3)).tolist()
