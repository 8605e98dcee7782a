// The current request as a `curl` command and as Python (the openai SDK), to copy. The key itself is
// never written out: both read it from $BITSERVE_API_KEY.

function shellQuote(text) {
  return `'${text.replaceAll("'", "'\\''")}'`;
}

export function curlSnippet(origin, body) {
  return [
    `curl -N ${origin}/v1/chat/completions \\`,
    `  -H "Content-Type: application/json" \\`,
    `  -H "Authorization: Bearer $BITSERVE_API_KEY" \\`,
    `  -d ${shellQuote(JSON.stringify(body, null, 2))}`,
  ].join("\n");
}

// A JSON value as a Python literal: strings and numbers read the same; booleans and null do not.
function pythonValue(value) {
  if (value === true) return "True";
  if (value === false) return "False";
  if (value === null) return "None";
  if (Array.isArray(value)) return `[${value.map(pythonValue).join(", ")}]`;
  if (typeof value === "object") {
    const items = Object.entries(value).map(([key, item]) => `${JSON.stringify(key)}: ${pythonValue(item)}`);
    return `{${items.join(", ")}}`;
  }
  return JSON.stringify(value);
}

export function pythonSnippet(origin, body) {
  const { messages, stream, ...params } = body;
  const lines = [
    "import os",
    "",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url="${origin}/v1", api_key=os.environ.get("BITSERVE_API_KEY", "none"))`,
    "stream = client.chat.completions.create(",
    "    messages=[",
    ...messages.map((message) => `        ${pythonValue(message)},`),
    "    ],",
    ...Object.entries(params).map(([name, value]) => `    ${name}=${pythonValue(value)},`),
    `    stream=${pythonValue(stream)},`,
    ")",
    "for chunk in stream:",
    "    if chunk.choices:",
    '        print(chunk.choices[0].delta.content or "", end="", flush=True)',
  ];
  return lines.join("\n");
}
