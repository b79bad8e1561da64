import os

# Tests run on the host CPU with eight fake devices (for the multi-device tests); the flag must be
# set before JAX is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
