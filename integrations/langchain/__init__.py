"""LangChain chat model for prefixserve: `ChatPrefixServe`, in-process or against a server.

    from integrations.langchain import ChatPrefixServe

    chat = ChatPrefixServe(model="smollm2-135m-instruct", max_tokens=64)       # in-process
    chat = ChatPrefixServe(base_url="http://127.0.0.1:8000/v1", model="smollm2")  # remote
    msg = chat.invoke("Hello")
    msg.usage_metadata["input_token_details"]["cache_read"]  # prompt tokens from the prefix cache
"""
from integrations.langchain.chat_model import ChatPrefixServe

__all__ = ["ChatPrefixServe"]
