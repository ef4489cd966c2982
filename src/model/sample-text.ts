// Original TinyStories-style texts (written for kvgate, not taken from the data set) to
// prefill stories260K with: long enough for 256-token chunks plus a held-out continuation.

/** Three short stories (~1,400 tokens in all with tok512). */
export const SAMPLE_STORIES: readonly string[] = [
  'Once upon a time, there was a little boy named Tim. Tim liked to play with his red ball in the yard. ' +
    'One day, the ball rolled into the garden of his neighbor, an old man named Mr. Brown. Tim was scared, ' +
    'but he wanted his ball back. He knocked on the door. Mr. Brown opened the door and smiled. "Hello, Tim. ' +
    'Is this your ball?" he asked. Tim nodded. Mr. Brown gave him the ball and a cookie too. Tim said, ' +
    '"Thank you!" From that day on, Tim and Mr. Brown were good friends. They played ball together every day, ' +
    'and Tim learned that being brave can make new friends. When it rained, they sat on the porch and ' +
    'watched the big drops fall. Mr. Brown told Tim stories about when he was a boy. He had a dog named Max ' +
    'who liked to chase the ducks at the pond. Tim laughed and laughed. He asked his mom if they could get a ' +
    'dog too. His mom said, "Maybe when you are a little bigger." Tim was happy. He ran to tell Mr. Brown.',
  'Lily had a small cat named Fluffy. Fluffy liked to sleep in the sun by the window. One morning, Fluffy ' +
    'was not in her bed. Lily looked under the table and behind the door. She looked in the kitchen and in ' +
    'the box of toys. She was sad. Then she heard a soft meow from the tree in the garden. Fluffy was stuck! ' +
    'Lily called her dad, and he got a long ladder. He climbed the tree very slowly. Fluffy jumped into his ' +
    'arms and purred. Dad gave Fluffy to Lily, and Lily hugged her cat. "Please do not go up the tree again," ' +
    'she said. Fluffy licked her nose. That night, Lily made a soft bed for Fluffy next to her own bed. ' +
    'They slept together, warm and happy. In the morning, the sun was bright and the birds sang. Fluffy ' +
    'looked at the birds, but she stayed inside with Lily. They ate breakfast and played with a ball of yarn.',
  'Ben and Sue went to the beach with their mom. The sand was warm and the water was blue. Ben wanted to ' +
    'build a big castle. Sue wanted to find shells. "Let\'s do both!" said Mom. They dug and dug. Ben made ' +
    'tall towers and Sue put pretty shells on the walls. A big wave came and hit the castle. The towers fell ' +
    'down. Ben was sad and started to cry. Sue gave him a hug. "We can build it again," she said. "And we can ' +
    'make it even better." They built the castle again, far from the water. This time it was bigger and ' +
    'stronger. Mom took a picture of the two of them next to their castle. When the sun went down, they ate ' +
    'ice cream and watched the sky turn pink and orange. Ben said it was the best day ever. Sue agreed. On ' +
    'the way home, they sang songs in the car until they fell asleep.',
]
