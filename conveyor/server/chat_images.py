"""A chat request's image parts -> its checked images, in prompt order (what RequestPlan.images carries).

Every API reaches this as chat's `image_url` parts (Messages' image blocks and Responses' input_image parts are
turned into them by their adapters), so each limit and each 400 is the same whichever API sent the image. The
order is the messages' and the parts' order: the order the chat template writes the image markers in.
"""

from __future__ import annotations

import asyncio

from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_fetch import ImagePolicy, ImageRef, load_image
from conveyor.multimodal.image_input import ImageInput
from conveyor.server import errors
from conveyor.server.protocol import ChatCompletionRequest


def image_refs(body: ChatCompletionRequest) -> list[ImageRef]:
    """Each image part as a reference named for its 400s ("image 2", messages.[i].content.[j])."""
    refs = []
    for i, message in enumerate(body.messages):
        for j, part in message.image_parts():
            param = f"messages.[{i}].content.[{j}]"
            if message.role not in ("user", "tool"):  # (tool: Anthropic's tool_result images, in that turn)
                raise errors.invalid(f"images belong in user messages (or tool results), not in a {message.role} "
                                     "message", param)
            refs.append(ImageRef(url=part.url, what=f"image {len(refs) + 1}", param=param))
    return refs


async def load_chat_images(body: ChatCompletionRequest, policy: ImagePolicy, refusal: str | None) -> list[ImageInput]:
    """`refusal`: why the model takes no images (None when it does): any image part is then that 400."""
    refs = image_refs(body)
    if not refs:
        return []
    if refusal is not None:
        raise errors.invalid(refusal, refs[0].param)
    if len(refs) > policy.max_images:
        raise errors.invalid(f"the request has {len(refs)} images; at most {policy.max_images} are allowed "
                             "(--max-images)", "messages")
    try:  # fetched and decoded side by side (decoding in worker threads), kept in order
        return list(await asyncio.gather(*(load_image(ref, policy) for ref in refs)))
    except InvalidRequestError as exc:
        raise errors.invalid(str(exc), exc.param) from None
