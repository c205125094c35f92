"""The worker role: owns a device, the model weights and the KV-cache tensors; runs forward + sampler."""
