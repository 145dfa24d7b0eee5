"""Chat templates for models whose files bring none: the turn format of their family, written into the .base
file by the converter so that every reader of the file renders chats the same way."""

from __future__ import annotations

# Gemma's turns (`<start_of_turn>user` / `<start_of_turn>model`, each closed by `<end_of_turn>`). Roles must
# alternate starting with the user; a system message is folded into the first user turn, as Gemma 3's own
# template does.
GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# .base arch -> the template its models get when they bring none.
BY_ARCH = {"gemma3": GEMMA_TURNS}
