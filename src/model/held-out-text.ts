// Held-out text for the codec's quality protocol (docs/codec.md): the sample stories plus
// five more, all written for kvgate (not from TinyStories), so windows can start at distinct stories.

import { SAMPLE_STORIES } from './sample-text.ts'

const MORE_STORIES: readonly string[] = [
  'Anna had a blue kite with a long tail. Every windy day she took it to the hill behind her house. One ' +
    'afternoon the wind was very strong. The kite went up, up, up, higher than the trees. Anna held the ' +
    'string tight, but the wind pulled hard and the string slipped out of her hands. The kite flew away over ' +
    'the field. Anna was sad and began to cry. Her brother Jack saw her and said, "Do not cry, Anna. We can ' +
    'find it together." They walked across the field and looked everywhere. They looked by the fence and ' +
    'near the old barn. At last they saw the kite stuck in a big apple tree. Jack was tall, so he climbed ' +
    'up on a low branch and pulled the kite down. The tail was torn, but the kite was fine. Anna hugged her ' +
    'brother. At home, Mom helped them fix the tail with a piece of red ribbon. Now the kite was blue and ' +
    'red. The next day the wind was soft and kind. Anna and Jack flew the kite together, and this time ' +
    'they held the string with four hands. Anna learned that a brother is a good friend to have.',
  'There was a little duck named Dot who lived by a quiet pond. Dot was the smallest duck in her family. ' +
    'Her sisters could swim fast, but Dot was slow. One day the ducks had a race across the pond. Dot tried ' +
    'her best, but she came last. The other ducks laughed at her. Dot swam away and hid behind the tall ' +
    'grass. An old frog sat on a rock nearby. "Why are you sad?" asked the frog. Dot told him about the race. ' +
    'The frog said, "You are not fast, but you are very good at finding things. I lost my shiny stone. Can ' +
    'you help me?" Dot looked under the leaves and between the rocks. Soon she found the shiny stone in the ' +
    'mud. The frog was very happy. That night a storm came and the ducks could not find their way home in ' +
    'the dark. Dot knew every path around the pond. She led her family to their nest, one by one. Her ' +
    'sisters said, "Thank you, Dot. We are sorry we laughed." Dot smiled. She knew that everyone is good at ' +
    'something, and that being slow is not bad at all.',
  'Sam and his dad went to the store to buy food for dinner. Sam pushed the cart. They got bread, milk, ' +
    'eggs and a big green apple. Sam wanted a box of candy, but Dad said, "Not today, Sam. We have fruit at ' +
    'home." Sam was a little grumpy. On the way out, they saw an old woman who dropped her bag. Oranges ' +
    'rolled all over the floor. Sam ran to help her. He picked up every orange and put them back in her bag. ' +
    'The woman said, "What a kind boy you are. Thank you very much." She gave Sam one orange to keep. Sam ' +
    'felt warm and happy inside. He forgot all about the candy. At home, Sam helped Dad make soup. He washed ' +
    'the carrots and Dad cut them. They put the soup on the stove and it smelled very good. After dinner, ' +
    'Sam ate his orange. It was sweet and juicy. He told Mom about the old woman and the oranges. Mom ' +
    'said she was proud of him. Sam went to bed with a big smile, thinking that helping feels better than ' +
    'candy tastes.',
  'Mia found a tiny bird on the ground under a tree. The bird could not fly. It had a hurt wing. Mia put ' +
    'the bird in a small box with soft cloth. She gave it water in a cap and little seeds to eat. Every ' +
    'morning Mia checked on the bird. She named it Pip. Pip chirped when Mia came near. After many days, ' +
    'Pip could flap his wing again. Mia took the box outside to the garden. She opened the lid. Pip hopped ' +
    'out and looked at the sky. Then he flew to the fence, and then to the tree. Mia waved and said, "Bye, ' +
    'Pip! Be safe!" She was happy, but she was also a little sad, because she would miss her friend. The ' +
    'next morning Mia heard a sound at her window. It was Pip! He sat on the window and sang a song. Pip ' +
    'came back every morning after that. Sometimes he brought a friend. Mia put seeds on the window for them. ' +
    'Her mom said that when you are kind to a small thing, it remembers you. Mia believed it was true.',
  'Leo had a new red truck. It was his favorite toy. He played with it in the sand box every day. One day ' +
    'a new girl named Zoe came to the park. She had no toys, and she sat alone on the bench. Leo saw that ' +
    'she looked sad. He did not want to share his truck, because it was new and shiny. He played by himself ' +
    'for a while, but it was not fun anymore. He kept looking at Zoe. At last Leo walked to the bench and ' +
    'said, "Do you want to play with my truck?" Zoe smiled a big smile. They took turns with the truck. Zoe ' +
    'made a road in the sand and Leo made a bridge with sticks. The truck drove over the bridge and into a ' +
    'tunnel. They played until the sun was low. When it was time to go home, Zoe said, "This was the best ' +
    'day. Can we play again tomorrow?" Leo said yes. He learned that a toy is more fun when you have a ' +
    'friend to share it with.',
]

/** Eight stories: the sample stories and five more (each window of the protocol starts at one). */
export const HELD_OUT_STORIES: readonly string[] = [...SAMPLE_STORIES, ...MORE_STORIES]
