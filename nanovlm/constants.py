"""Facts the data and the model must agree on, in one place."""

IGNORE_INDEX = -100  # the label of a position that takes no loss (torch's cross_entropy ignore_index default)
IMAGE_TOKEN = "<image>"  # stands for one image: in message text, and as a special token in the vocabulary
DEFERRED_JPEGS = "jpegs"  # a batch's JPEGs still to be decoded on the device (data.image_decode=device)
