"""Facts two parts of the code must agree on (the data and the model, the config and what it configures), in one
place: each module imports them from here, so no module imports another for a constant."""

IGNORE_INDEX = -100  # the label of a position that takes no loss (torch's cross_entropy ignore_index default)
IMAGE_TOKEN = "<image>"  # stands for one image: in message text, and as a special token in the vocabulary
DEFERRED_JPEGS = "jpegs"  # a batch's JPEGs still to be decoded on the device (data.image_decode=device)
IMAGE_DECODES = ("worker", "device")  # data.image_decode: where a JPEG is decoded
CHAT_FORMATS = ("chatml", "smolvlm")  # data.chat_format: how turns are framed (data/chat.py)
BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa")  # model.attn_backend (model/attention.py)
LOSS_KERNELS = ("auto", "torch", "liger")  # model.loss_kernel (model/loss.py)
# larger JPEGs are decoded in the worker (draft scaling) rather than held whole on the device
DEVICE_MAX_PIXELS = 16_000_000
MAX_SHUFFLE_BUFFER = 1 << 20  # data.shuffle_buffer at most: the window shuffle's keys fit one int64
