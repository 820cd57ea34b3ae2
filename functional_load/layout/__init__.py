"""2. What a rank holds: slice descriptors with behaviour, parallel settings, quantized-linear
manifests, and :func:`.build.build_layout`."""
