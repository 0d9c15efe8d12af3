"""NumPy references of the Metal kernel families and the cases that run them through lily._core.kernels on
the device it chose (kernels.set_device): tests/test_<family>.py run them under every schedule and edge
shape; `lily doctor` runs a small case of each on the machine's device. numpy only."""
