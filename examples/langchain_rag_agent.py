"""RAG and a small tool-using agent on prefixserve through LangChain, printing the prefix-cache hits of
every call.

    .venv/bin/python examples/langchain_rag_agent.py                     # in-process (loads SmolLM2)
    .venv/bin/python examples/langchain_rag_agent.py --base-url http://127.0.0.1:8000/v1   # `make serve`

Every question repeats the same system prompt and retrieved context, and every agent step re-sends
the whole conversation: prefixserve computes that shared prefix once, and `cache_read` shows how many
prompt tokens each call took from the cache instead of recomputing them.
"""
from __future__ import annotations

import argparse

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool

from integrations.langchain import ChatPrefixServe

SYSTEM = ("You are the support assistant of Northwind Bikes. Answer in one short sentence, using only "
          "the context below.")
DOCUMENTS = {
    "returns": "Returns: unused bikes can be returned within 30 days of delivery for a full refund. Used "
               "bikes can be returned within 14 days for a refund minus a 10% restocking fee. Refunds "
               "reach the original payment method within 5 business days.",
    "shipping": "Shipping: orders ship from Rotterdam within 2 business days. Delivery takes 3 to 5 days "
                "in the EU and 7 to 10 days elsewhere. Every order has a tracking number.",
    "warranty": "Warranty: frames carry a lifetime warranty; components are covered for 2 years. "
                "Batteries of e-bikes are covered for 500 charge cycles or 2 years.",
}
# Short greedy answers; frequency_penalty keeps a 135M model out of loops; one tool call per turn (a
# forced call may otherwise be repeated until max_tokens).
SETTINGS = {"max_tokens": 48, "temperature": 0, "frequency_penalty": 1.0, "parallel_tool_calls": False}
ORDERS = {1042: "shipped on May 3, arriving May 7", 2077: "being packed, ships tomorrow"}


def retrieve(question: str, k: int = 2) -> str:
    """A toy retriever: the k documents sharing the most words with the question, in a fixed order."""
    words = set(question.lower().split())
    ranked = sorted(DOCUMENTS, key=lambda name: -len(words & set(DOCUMENTS[name].lower().split())))
    return "\n\n".join(DOCUMENTS[name] for name in sorted(ranked[:k]))


def cache_hits(message: AIMessage) -> str:
    usage = message.usage_metadata
    return f"{usage['input_token_details']['cache_read']:4d} of {usage['input_tokens']:4d} prompt tokens from cache"


@tool
def get_order_status(order_number: int) -> str:
    """Look up the shipping status of an order by its number."""
    return ORDERS.get(order_number, f"there is no order {order_number}")


def rag(chat: ChatPrefixServe, questions: list[str]) -> list[AIMessage]:
    """Several questions over one system prompt and one retrieved context: a shared prefix."""
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM + "\n\nContext:\n{context}"), ("human", "{question}")])
    chain = prompt | chat
    context = retrieve(" ".join(questions))
    answers = []
    for question in questions:
        answer = chain.invoke({"context": context, "question": question})
        print(f"rag   | {cache_hits(answer)} | {question} -> {answer.content.strip()}")
        answers.append(answer)
    return answers


def agent(chat: ChatPrefixServe, question: str, max_steps: int = 3) -> list[AIMessage]:
    """A tool-using loop: call tools until the model answers in text. The first step forces a tool call
    (tool_choice "any", decoded under a grammar, so the call is always valid); later steps let the
    model choose. Each step re-sends the conversation so far, which the cache already holds."""
    forced = chat.bind_tools([get_order_status], tool_choice="any")
    free = chat.bind_tools([get_order_status])
    messages = [SystemMessage(SYSTEM), HumanMessage(question)]
    replies = []
    for step in range(max_steps):
        reply = (forced if step == 0 else free).invoke(messages)
        calls = ", ".join(f"{c['name']}({c['args']})" for c in reply.tool_calls)
        print(f"agent | {cache_hits(reply)} | step {step}: {calls or reply.content.strip()}")
        replies.append(reply)
        messages.append(reply)
        if not reply.tool_calls:
            break
        messages.extend(get_order_status.invoke(call) for call in reply.tool_calls)  # ToolMessages
    return replies


def run(chat: ChatPrefixServe) -> tuple[list[AIMessage], list[AIMessage]]:
    answers = rag(chat, ["How long do I have to return a used bike?", "How fast is delivery in the EU?",
                         "When does my refund arrive?"])
    steps = agent(chat, "Where is my order 1042?")
    return answers, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a prefixserve server's /v1 URL (default: run the engine in-process)")
    args = parser.parse_args()
    if args.base_url is None:
        chat = ChatPrefixServe(model="smollm2-135m-instruct", **SETTINGS)  # in-process
    else:
        chat = ChatPrefixServe(base_url=args.base_url, **SETTINGS)  # against `make serve`
    try:
        run(chat)
    finally:
        chat.close()


if __name__ == "__main__":
    main()
